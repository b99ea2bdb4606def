"""The GPU check's kernel rows (`benchmarks/gpu_check.py`): each Triton kernel against its torch twin."""

from __future__ import annotations

from benchmarks.gpu_compiled import timed


def kernel_pairs(model, cfg: dict) -> dict:
    """Each Triton kernel against its torch twin at the round's sizes: median ms of each and the max error."""
    import torch

    from hf_spec.kernels.triton import draft_topk as dt
    from hf_spec.kernels.triton import greedy_accept as ga
    from hf_spec.kernels.triton import kv_compact as kc
    from hf_spec.kernels.triton import sampling_accept as sa
    from hf_spec.kernels.triton import token_info_topk as ti
    from hf_spec.kernels.triton import tree_mask as tm

    dev, conf, n, reps = model.device, model.config, cfg["kernel_nodes"], cfg["reps"]
    g = torch.Generator().manual_seed(0)
    parents = torch.tensor(
        [-1] + [int(torch.randint(-1, i, (1,), generator=g)) for i in range(1, n)], device=dev
    )
    tokens = torch.randint(0, 50, (n,), generator=g).to(dev)
    logits = torch.randn(n + 1, conf.vocab_size, device=dev)
    logits[parents + 1, tokens] = 30.0  # every node is its parent's argmax: a long accepted path
    heads, dim = conf.num_key_value_heads, conf.hidden_size // conf.num_attention_heads
    layers = [torch.randn(1, heads, cfg["context"] + n + 1, dim, device=dev, dtype=model.dtype)
              for _ in range(2 * conf.num_hidden_layers)]  # fmt: skip
    keep = [0, *sorted(torch.randperm(n, generator=g)[: n // 4].add(1).tolist())]
    rank, draft_vocab = 64, min(32000, conf.vocab_size)
    low = torch.randn(8, rank, device=dev, dtype=model.dtype)
    w2 = torch.randn(draft_vocab, rank, device=dev, dtype=model.dtype) / 8
    scale = torch.full((draft_vocab,), 0.1, device=dev, dtype=model.dtype)
    raw, valid = torch.randn(draft_vocab, device=dev), torch.ones(8, device=dev)
    rows = torch.randn(10, conf.vocab_size, device=dev, dtype=model.dtype)
    narrow = {w: rows[:, :w].contiguous() for w in (8192, 32000) if w < conf.vocab_size}

    def seeded(fn):  # the same random numbers for both
        generator = torch.Generator(device=dev)
        return lambda: sa.unpack_sampling(
            fn(logits, parents, tokens, None, generator.manual_seed(1)).tolist()
        )

    mine, theirs = [t.clone() for t in layers], [t.clone() for t in layers]  # moved in place, as often each
    pairs = {
        "greedy_accept": (lambda: ga.unpack_greedy(ga.greedy_accept(logits, parents, tokens).tolist(), n),
                          lambda: ga.unpack_greedy(ga.greedy_accept_reference(logits, parents, tokens).tolist(), n)),
        "sampling_accept": (seeded(sa.sampling_accept), seeded(sa.sampling_accept_reference)),
        "kv_compact": (lambda: kc.kv_compact(mine, cfg["context"], keep),
                       lambda: kc.kv_compact_reference(theirs, cfg["context"], keep)),
        "tree_mask": (lambda: tm.tree_inputs(parents, cfg["context"], model.dtype),
                      lambda: tm.tree_inputs_reference(parents, cfg["context"], model.dtype)),
        "draft_topk": (lambda: dt.draft_topk(rows, 10), lambda: dt.draft_topk_reference(rows, 10)),
        # the draft vocabularies heads decode with (vocab_limit 8192; a 32K draft vocabulary): the row's width
        # decides between one program a row and torch's top-k
        **{f"draft_topk@{w}": (lambda r=narrow[w]: dt.draft_topk(r, 10), lambda r=narrow[w]: dt.draft_topk_reference(r, 10))
           for w in narrow},
        "token_info_topk": (lambda: ti.token_info_topk(raw, 8, 8, valid, factors=(low, w2, scale)),
                            lambda: ti.token_info_topk_reference(raw, 8, 8, valid, factors=(low, w2, scale))),
    }  # fmt: skip
    out = {}
    for name, (kernel, twin) in pairs.items():
        got, want = kernel(), twin()
        if name == "kv_compact":
            got, want = mine, theirs
        out[name] = {"kernel_ms": 1e3 * timed(kernel, dev, 5 * reps), "torch_ms": 1e3 * timed(twin, dev, 5 * reps),
                     "max_error": max_error(got, want)}  # fmt: skip
        out[name]["speedup"] = out[name]["torch_ms"] / out[name]["kernel_ms"]
    return out


def max_error(a, b) -> float:
    """Largest absolute difference between two results (nested tuples/lists of tensors or ints)."""
    import torch

    if isinstance(a, (list, tuple)) and not (a and isinstance(a[0], int)):
        return max((max_error(x, y) for x, y in zip(a, b, strict=True)), default=0.0)
    a, b = torch.as_tensor(a).double().cpu(), torch.as_tensor(b).double().cpu()
    if a.shape != b.shape:
        return float("inf")
    finite = torch.isfinite(a) & torch.isfinite(b)
    return float(((a - b).abs() * finite).max()) + float((torch.isfinite(a) != torch.isfinite(b)).any())
