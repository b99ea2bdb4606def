"""Compiled speculative decoding on a GPU, most important phases first, the report saved after each.

    python benchmarks/gpu_compiled_check.py --out DIR [--shapes 1b,8b] [--budget-s 470] [--reference self|generate|eager]
        [--no-static]

For each random-weight target of a real shape (`benchmarks/gpu_check.py`'s 1B- and 8B-shaped Llamas, bfloat16,
prompt of 512 random tokens, 128 new tokens; nothing downloaded):
- eager `generate`, then transformers' compiled static-cache `generate` (`reduce-overhead`, CUDA graphs), tokens/s
  after warm-up, and whether its greedy tokens equal eager's;
- `oracle:k` with `SpeculativeDecoder(..., compile=True)`: the first call (compiles every padded width), then a timed
  call, against compiled `generate`, with the round's split (`time_verify`, `time_draft`, `time_other`). The oracle
  drafts the reference: `--reference generate` / `eager` (compiled / eager `generate`'s tokens; where the speculative rounds' bfloat16
  sums pick another token at a near-tie the drafts stop matching) or `--reference self` (default: the decoder's own
  first output, the ceiling of the loop's speed);
- (1b, unless `--no-static`) the target's forward over a static cache at 1, 4, 16, 64 rows, eager and compiled.
Writes `DIR/driver.json` and prints each phase as it ends.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from benchmarks import gpu_check as check  # noqa: E402
from benchmarks import gpu_compiled as gc  # noqa: E402


def oracle_rows(model, ids, ks, reference, compiled_s, new, budget, self_reference: bool) -> dict:
    """`oracle:k` compiled against compiled `generate` (`compiled_s` seconds for `new` tokens), per k."""
    from hf_spec import SpeculativeDecoder

    want = reference[0, ids.shape[1] :].tolist()
    res: dict = {}
    for k in ks:
        if budget.left() < 40:
            res[k] = "skipped: budget"
            break
        decoder = SpeculativeDecoder(f"oracle:{k}", compile=True)
        decoder.drafter_for(model).set_reference(reference)
        t0 = time.perf_counter()
        _, first_tokens = gc.generate_tokens(model, ids, new, custom_generate=decoder)
        first = time.perf_counter() - t0
        if self_reference:
            own = torch.cat([ids, torch.tensor([first_tokens], device=ids.device)], dim=1)
            decoder.drafter_for(model).set_reference(own)
        seconds, tokens = gc.generate_tokens(model, ids, new, custom_generate=decoder)
        stats = decoder.last_stats
        res[k] = {
            "first_call_s": first, "seconds": seconds, "tokens_per_s": new / seconds,
            "speedup_vs_compiled_generate": compiled_s / seconds,
            "first_difference_from_compiled_generate": next(
                (i for i, (a, b) in enumerate(zip(tokens, want, strict=True)) if a != b), None),
            "same_as_first_call": tokens == first_tokens,
            "compiled_rounds": stats.compiled_rounds, "target_forwards": stats.target_forwards,
            "time_verify": stats.time_verify, "time_draft": stats.time_draft, "time_other": stats.time_other,
        }  # fmt: skip
        print(k, res[k], flush=True)
    return res


def compiled_generate(model, ids, new: int, eager: list[int], device) -> dict:
    """`benchmarks.gpu_compiled.compiled_generate`'s row plus compiled `generate`'s own tokens (`tokens`)."""
    from transformers import CompileConfig

    res = gc.compiled_generate(model, ids, new, eager)
    config = CompileConfig(fullgraph=True, dynamic=False, mode=gc.compile_options(device)["mode"])
    if device.type != "cuda":
        config._compile_all_devices = True
    res["tokens"] = gc.generate_tokens(model, ids, new, cache_implementation="static", compile_config=config)[
        1
    ]
    return res


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", default="1b,8b", help="comma list of 1b, 8b, tiny")
    parser.add_argument("--budget-s", type=float, default=470.0)
    parser.add_argument("--reference", choices=("self", "generate", "eager"), default="self")
    parser.add_argument("--no-static", action="store_true", help="skip the static-cache forward costs")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    budget = gc.Budget(args.budget_s, 60.0)
    tiny = args.shapes == "tiny"
    context, new = (24, 12) if tiny else (512, 128)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "dtype": str(dtype), "context": context, "new": new,
              "reference": args.reference, "shapes": {}}  # fmt: skip

    def save() -> None:
        (out / "driver.json").write_text(json.dumps(report, indent=1, default=str))

    def phase(res: dict, name: str, fn, *a) -> None:
        t0 = time.perf_counter()
        try:
            res[name] = fn(*a)
        except Exception as e:  # a failed phase is reported, the check goes on
            res[name] = {
                "error": f"{type(e).__name__}: {str(e)[:400]}",
                "trace": traceback.format_exc()[-1500:],
            }
        res.setdefault("phase_s", {})[name] = time.perf_counter() - t0
        print(name, f"{res['phase_s'][name]:.1f}s", json.dumps(res[name], default=str)[:600], flush=True)
        save()

    for shape in args.shapes.split(","):
        if budget.left() < 60:
            report["shapes"][shape] = "skipped: budget"
            save()
            continue
        r = report["shapes"][shape] = {}
        t0 = time.perf_counter()
        with gc.allow_recompiles():
            model = check.build_target(shape, device, dtype)
            ids = torch.randint(
                3, model.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(0)
            )
            ids = ids.to(device)
            gc.generate_tokens(model, ids, 4)
            gc.generate_tokens(model, ids, new)
            plain_s, eager = gc.generate_tokens(model, ids, new)
            r["eager_generate_tokens_per_s"] = new / plain_s
            r["build_s"] = time.perf_counter() - t0
            print(shape, r, flush=True)
            save()

            phase(r, "compiled_generate", compiled_generate, model, ids, new, eager, device)
            cg = r["compiled_generate"]
            if "tokens_per_s" in cg:
                drafted = eager if args.reference == "eager" else cg["tokens"]
                reference = torch.cat([ids, torch.tensor([drafted], device=device)], dim=1)
                ks = [8, 4] if shape != "8b" else [8]
                phase(r, "compiled_oracle", oracle_rows, model, ids, ks, reference, new / cg["tokens_per_s"], new,
                      budget, args.reference == "self")  # fmt: skip
            if shape != "8b" and budget.left() > 150 and not args.no_static:
                widths = [1, 4] if tiny else [1, 4, 16, 64]
                phase(r, "verify_static", gc.static_verification_costs, model, ids, widths, 5, budget,
                      budget.deadline - 100)  # fmt: skip
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    save()
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
