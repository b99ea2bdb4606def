"""Ahead-of-time compilation of every Triton kernel for an H100 (sm_90) with the `ptxas` triton ships, no GPU
needed: `python -m tests.triton_signatures` (without `TRITON_INTERPRET`, whose kernels cannot be compiled). It
catches what the interpreter lets pass: types of loop-carried values, unsupported control flow."""

from __future__ import annotations

import sys


def kernel_signatures():
    """`(kernel, argument types, constants)` of every kernel, as the wrappers launch them on the round's sizes."""
    import triton.language as tl

    from hf_spec.kernels.triton import draft_topk as dt
    from hf_spec.kernels.triton import greedy_accept as ga
    from hf_spec.kernels.triton import kv_compact as kc
    from hf_spec.kernels.triton import sampling_accept as sa
    from hf_spec.kernels.triton import token_info_topk as ti
    from hf_spec.kernels.triton import tree_mask as tm

    i32, i64, f32 = "i32", "i64", "fp32"
    rows = {"stride_row": i32, "vocab": i32}
    argmax = {"logits_ptr": "*bf16", **rows, "max_ptr": "*fp32", "idx_ptr": "*i32", "num_chunks": i32}
    yield ga._chunk_argmax, argmax, {"CHUNK": ga.CHUNK, "BLOCK": ga.BLOCK}
    walk = {
        "max_ptr": "*fp32",
        "idx_ptr": "*i32",
        "num_chunks": i32,
        "parents_ptr": "*i64",
        "tokens_ptr": "*i64",
    }
    yield ga._walk, {**walk, "num_nodes": i32, "out_ptr": "*i64"}, {"CHUNKS_BLOCK": 64, "NODES_BLOCK": 64}
    stats = {"scores_ptr": "*fp32", **rows, "max_ptr": "*fp32", "sum_ptr": "*fp32", "num_chunks": i32}
    yield sa._chunk_softmax_stats, stats, {"CHUNK": sa.CHUNK, "BLOCK": sa.BLOCK}
    tree = {
        "parents_ptr": "*i64",
        "tokens_ptr": "*i64",
        "sampled_ptr": "*i8",
        "q_ptr": "*fp32",
        "stride_q": i32,
    }
    out = {"u_ptr": "*fp32", "num_nodes": i32, "resid_ptr": "*fp32", "stats_ptr": "*fp32", "out_ptr": "*i64"}
    yield sa._walk, {**stats, **tree, **out}, {"CHUNKS_BLOCK": 64, "NODES_BLOCK": 64, "BLOCK": sa.BLOCK}
    final = {"scores_ptr": "*fp32", **rows, "resid_ptr": "*fp32", "stats_ptr": "*fp32", "out_ptr": "*i64"}
    yield sa._final_residual, {**final, "num_nodes": i32}, {"NODES_BLOCK": 64, "BLOCK": sa.BLOCK}
    mask = {
        "parents_ptr": "*i64",
        "num_nodes": i32,
        "past": i32,
        "mask_ptr": "*bf16",
        "positions_ptr": "*i64",
    }
    yield tm._tree_mask, {**mask, "min_value": f32}, {"BLOCK": tm.BLOCK, "NODES_BLOCK": 64}
    table = {"table_ptr": "*i64", "num_tensors": i32, "num_keep": i32, "past": i32, "heads": i32}
    strides = {"stride_b": i64, "stride_h": i64, "stride_s": i64, "dim": i32}
    yield kc._compact, {**table, **strides}, {"DTYPE": tl.bfloat16, "BLOCK_D": 128}
    one = {"t_ptr": "*bf16", "keep_ptr": "*i64", "num_keep": i32, "past": i32, "heads": i32}
    yield kc._compact_one, {**one, **strides}, {"BLOCK_D": 128}
    topk = {"logits_ptr": "*bf16", **rows, "values_ptr": "*fp32", "indices_ptr": "*i64"}
    yield dt._draft_topk, topk, {"K": 8, "BLOCK": dt.BLOCK}
    info = {"raw_ptr": "*fp32", "cols_n": i32, "bias_ptr": "*bf16", "stride_bias": i32, "low_ptr": "*bf16"}
    info |= {"stride_low": i32, "w2_ptr": "*bf16", "stride_w2": i32, "scale_ptr": "*bf16", "full_vocab": i32}
    info |= {"rank": i32, "valid_ptr": "*fp32", "eps": f32, "values_ptr": "*fp32", "indices_ptr": "*i64"}
    for mode in (ti.NONE, ti.DENSE, ti.LOW_RANK):
        yield ti._token_info_topk, info, {"K": 4, "MODE": mode, "BLOCK": ti.BLOCK, "RANK_BLOCK": 64}


def main() -> int:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    for fn, signature, constants in kernel_signatures():
        types = {**signature, **dict.fromkeys(constants, "constexpr")}
        compiled = triton.compile(ASTSource(fn=fn, signature=types, constexprs=constants), target=target)
        assert "cubin" in compiled.asm, fn.__name__
        print("compiled", fn.__name__, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
