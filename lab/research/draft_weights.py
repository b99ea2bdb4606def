"""What packed draft weights save.

    python lab/research/draft_weights.py --linears     # the linears of 22 Qwen2.5-0.5B-shaped layers, 1-11 rows
    python lab/research/draft_weights.py --step        # a layer-22 early-exit draft step of the real target

`--linears`: random weights of Qwen2.5-0.5B's layer shapes (1.3 GB in float32, so they stream from DRAM as a draft
step's do), float32 kernel vs int8 with float32 x (W8A32) vs torch's int4 vs int8 with int8 x (the VNNI kernel
alone). `--step`: layers [0, 22) and the exit head of the committed exit heads (draft vocabulary) on one token
after 300 cached tokens, the drafting layers' linears on float32 kernels / int8 / int4 copies / stock torch.
Median ms of several runs, 2 threads.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from hf_spec.kernels import cpu_skinny_gemm as csg
from hf_spec.kernels.skinny_linear import fast_linears, skinny_linear
from hf_spec.kernels.weight_only import QuantizedWeight, draft_linears

SHAPES = [
    (896, 896),
    (128, 896),
    (128, 896),
    (896, 896),
    (4864, 896),
    (4864, 896),
    (896, 4864),
]  # q k v o gate up down


def linears(layers: int = 22, reps: int = 5) -> None:
    ws = [torch.randn(n, k) / k**0.5 for _ in range(layers) for n, k in SHAPES]
    int8 = [QuantizedWeight.from_weight(w, "int8", max_rows=32) for w in ws]
    int4 = [QuantizedWeight.from_weight(w, "int4", max_rows=32) for w in ws]

    def as_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        step = (x.abs().amax(dim=1) / 127).clamp(min=1e-30)
        return (torch.round(x / step[:, None]) + 128).to(torch.uint8), step

    def run(f, rows: int) -> float:
        times = []
        for _ in range(reps):
            xs = {k: torch.randn(rows, k) for k in (896, 4864)}
            pre = {k: as_int8(v) for k, v in xs.items()}  # outside the timing: the kernel alone
            t = time.perf_counter()
            for j, w in enumerate(ws):
                f(j, xs[w.shape[1]], pre[w.shape[1]])
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1000

    print(
        f"linears of {layers} layers, ms: rows | float32 kernel | int8, fp32 x | int4 (torch) | int8, int8 x (VNNI)"
    )
    for rows in (1, 2, 3, 4, 6, 8, 11):
        cols = [
            run(lambda j, x, p: skinny_linear(x, ws[j]), rows),
            run(lambda j, x, p: csg.kernel_linear_int8(x, int8[j].packed, int8[j].scales), rows),
            run(lambda j, x, p: int4[j].linear(x), rows),
        ]
        if csg.has_vnni():
            cols.append(
                run(
                    lambda j, x, p: csg.kernel_linear_u8s8(*p, int8[j].packed, int8[j].qsum, int8[j].scales),
                    rows,
                )
            )
        print(rows, " | ".join(f"{c:.1f}" for c in cols))


def step(target: str, heads: str, exit_layer: int = 22, past: int = 300, reps: int = 9) -> None:
    from transformers import DynamicCache

    from hf_spec.engine.target.cache import crop_cache
    from hf_spec.methods.early_exit.drafter import quantize_draft_layers
    from hf_spec.methods.early_exit.exit_heads import load_exit_lm
    from hf_spec.models import load_model
    from hf_spec.models.layers import decoder_parts, run_layers

    model, _ = load_model(target)
    parts = decoder_parts(model)
    exits = load_exit_lm(model, heads, draft_vocab=True)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.randint(100, 10000, (1, past)), past_key_values=cache, use_cache=True)

    def timed(weights) -> tuple[float, float]:
        layer_ms, head_ms = [], []
        for _ in range(reps):
            token = torch.randint(100, 10000, (1, 1))
            with torch.no_grad(), weights():
                t0 = time.perf_counter()
                h = run_layers(parts, parts.embed_tokens(token), torch.tensor([[past]]), cache, 0, exit_layer)
                t1 = time.perf_counter()
                exits.logits(exit_layer, h)[0, -1].argmax()
                t2 = time.perf_counter()
            crop_cache(cache, past, range(exit_layer))
            layer_ms.append(t1 - t0), head_ms.append(t2 - t1)
        return statistics.median(layer_ms) * 1000, statistics.median(head_ms) * 1000

    def packed(scheme: str):
        q = quantize_draft_layers(parts, exit_layer, scheme)
        return lambda: draft_linears(model, q)

    print(f"{target}: a draft step of layers [0, {exit_layer}) + exit head after {past} cached tokens, ms")
    rows = [("float32 kernels", lambda: fast_linears(model))]
    rows += [(scheme, packed(scheme)) for scheme in ("int8", "int4")] + [
        ("stock torch", contextlib.nullcontext)
    ]
    for name, weights in rows:
        layer_ms, head_ms = timed(weights)
        print(f"{name}: layers {layer_ms:.1f}, exit head {head_ms:.1f} (its float32 rows)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--linears", action="store_true")
    ap.add_argument("--step", action="store_true")
    ap.add_argument("--target", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--exit-heads", default="model_cards/exits-qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not (args.linears or args.step):
        ap.error("say --linears and/or --step")
    if args.linears:
        linears()
    if args.step:
        step(args.target, args.exit_heads)


if __name__ == "__main__":
    main()
