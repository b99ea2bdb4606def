"""Triton kernels of the round's own work, behind the `triton` backend (`hf_spec.engine.backend.TritonBackend`).

One kernel per module, each next to its torch twin (the reference the parity tests and `benchmarks/gpu_check.py`
compare it with):

- `greedy_accept`: greedy tree acceptance (argmax of every verification row, then the walk) -> one packed tensor;
- `sampling_accept`: recursive rejection sampling over a tree, with the loop's uniforms and `q` semantics;
- `kv_compact`: keep the root's and the accepted nodes' KV-cache slots, every layer of a group in one launch;
- `tree_mask`: the tree attention mask and position ids from the parent array;
- `draft_topk`: log-softmax + top-k of a draft head's rows (EAGLE's draft vocabulary);
- `token_info_topk`: Lyanna's level logits + low-rank token-info bias -> log-softmax + top-k children.

Each kernel's launches run as a torch custom operator (`torch.ops.hf_spec.*`, defined by `op.kernel_op`: a
`torch.library.triton_op` on CUDA), so compiled graphs call them without a graph break.

These modules import triton: only the triton backend imports them, never the CPU path. On CPU tensors they run
under Triton's interpreter (`TRITON_INTERPRET=1`, set before triton is imported), which is how CI checks them.
"""
