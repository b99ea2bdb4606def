"""The GPU check: one command that measures what hf-spec's loop costs on a GPU, eager and compiled.

    python benchmarks/gpu_check.py --out DIR [--rounds FILE ...]   # FILE: `hf-spec bench --record-rounds FILE`
    python benchmarks/gpu_check.py --out DIR --tiny       # CPU, tiny shapes, Triton's interpreter: keeps it working

Random-weight targets of real shapes are built on the device (Llama-3.2-1B- and Llama-3.1-8B-shaped, bfloat16,
sdpa; on the meta device first, then filled there: nothing is downloaded). For each it measures and writes
`DIR/gpu_check.json` and `DIR/gpu_check.md`:

- plain `generate` tokens/s, eager and compiled (transformers' static cache + `compile_config`; on CUDA
  `reduce-overhead`), and whether the compiled greedy tokens equal the eager ones;
- verification cost of 0, 1, 2, 4, ..., 64 tree nodes relative to one step (a one-token forward), and over a static
  cache at 1, 2, 4, ..., 64 rows, eager and compiled (each width compiled once: the curve without launches);
- the loop's own time a round (outside the drafter and the target's forward) and its device-to-host syncs a round
  (`torch.cuda.set_sync_debug_mode` on CUDA, host reads of tensor values on the CPU), torch and triton backends;
- `oracle:k` speedup ceilings, k = 2, 4, 8, 16, both backends;
- each Triton kernel against its torch twin (milliseconds, max error) at the round's real sizes;
- a replay of recorded rounds (`hf-spec bench --record-rounds FILE`): each method's speedup at this target's
  costs (`hf_spec.bench.rounds.replay_speedup`) and the three paper ratios (Lyanna / HASS head, HiSpec / best
  single exit, Talon / its better half), against eager `generate` and against compiled `generate` at the compiled
  verification costs;
- with `--compile`: `oracle:k` with `SpeculativeDecoder(..., compile=True)` against compiled `generate` (recorded
  as not available where the installed hf-spec has no such keyword).

`--budget-s` (default 570) bounds the whole run: each shape gets an equal share of the time left when it starts,
each phase prints its seconds, and a phase (or a compiled width) that cannot fit is skipped and listed in the report.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.gpu_compiled import sync, timed  # noqa: E402  (the repository's folder, on the path from here)

SHAPES = {  # the configs of the real models, without their weights
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1000),
}  # fmt: skip
# compile_guess_s: a compile's seconds before one was timed; need_s: seconds kept free for the phases after the
# compiled curve (estimates: the whole 1B check took 152 s on an H200 with 15 values of k, most of it oracle runs)
GPU = dict(context=512, new=128, ks=[2, 4, 8, 16], nodes=[0, 1, 2, 4, 8, 16, 32, 64], reps=5, kernel_nodes=64,
           widths=[1, 2, 4, 8, 16, 32, 64], compile_guess_s=60.0, need_s={"backends": 80.0, "kernels": 20.0})  # fmt: skip
TINY = dict(context=24, new=12, ks=[2, 4], nodes=[0, 1, 2, 4], reps=1, kernel_nodes=8, widths=[1, 4],
            compile_guess_s=0.0, need_s={})  # fmt: skip
HOST_READS = ("tolist", "item", "__int__", "__float__", "__bool__")


def build_target(shape: str, device, dtype):
    """A random-weight Llama of `shape`: built on the meta device, allocated and filled on `device`."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        **SHAPES[shape], bos_token_id=1, eos_token_id=2, pad_token_id=0, max_position_embeddings=4096
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0) if p.dim() == 1 else p.normal_(0.0, 0.02, generator=generator)
        for module in model.modules():  # buffers computed at init (rotary frequencies): computed again there
            if hasattr(module, "inv_freq"):
                fresh = type(module)(model.config)  # on the CPU: a few numbers
                for name, buffer in fresh.named_buffers(recurse=False):
                    setattr(module, name, buffer.to(device))
    model.generation_config.eos_token_id = None  # random weights: every run decodes its full length
    model.generation_config.pad_token_id = 0
    return model.eval()


def generate_seconds(model, ids, new: int, decoder=None) -> float:
    kw = dict(max_new_tokens=new, do_sample=False)  # no EOS (build_target): every run decodes `new` tokens
    if decoder is not None:
        kw["custom_generate"] = decoder
    sync(model.device)
    t0 = time.perf_counter()
    model.generate(ids, **kw)
    sync(model.device)
    return time.perf_counter() - t0


def verification_costs(model, ids, nodes: list[int], reps: int) -> tuple[dict[int, float], dict[int, float]]:
    """`({tokens: seconds of one forward of [root] + tree}, {rows: seconds of the LM head})` after `ids`."""
    import torch
    from transformers import DynamicCache

    from hf_spec.core.compat import cache_kwargs
    from hf_spec.engine.target.cache import crop_cache
    from hf_spec.engine.target.forward import verification_inputs
    from hf_spec.tree import DraftTree

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids[:, :-1], **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
        past, root = ids.shape[1] - 1, ids[:, -1:]
        forward, head = {}, {}
        for n in nodes:  # a chain with its last node moved up: a branching tree, as the loop verifies
            parents = list(range(-1, n - 2)) + [n - 3] if n > 2 else list(range(-1, n - 1))
            tree = DraftTree(torch.full((n,), 7), torch.tensor(parents, dtype=torch.long))
            inputs, positions, mask = verification_inputs(model, root, tree, past)

            def step(inputs=inputs, positions=positions, mask=mask):
                kw = cache_kwargs(model, cache)
                model(input_ids=inputs, position_ids=positions, attention_mask=mask, **kw, use_cache=True)
                crop_cache(cache, past)

            forward[n + 1] = timed(step, model.device, reps)
            h = torch.randn(1, n + 1, model.config.hidden_size, device=model.device, dtype=model.dtype)
            head[n + 1] = timed(lambda h=h: model.lm_head(h), model.device, reps)
    return forward, head


@contextlib.contextmanager
def round_clock(device, totals: dict):
    """Time every round, the drafter's proposal and the target's forward in it (synchronized), and count rounds."""
    from hf_spec.core.drafter import Drafter
    from hf_spec.engine.round import RoundEngine

    step, propose, forward = RoundEngine.step, RoundEngine.propose, Drafter.verify_forward

    def clocked(key, fn):
        def run(*args, **kwargs):
            sync(device)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                sync(device)
                totals[key] = totals.get(key, 0.0) + time.perf_counter() - t0
                totals[key + "_calls"] = totals.get(key + "_calls", 0) + 1

        return run

    RoundEngine.step = clocked("round", step)
    RoundEngine.propose = staticmethod(clocked("propose", propose))
    Drafter.verify_forward = clocked("forward", forward)
    try:
        yield
    finally:
        RoundEngine.step, RoundEngine.propose, Drafter.verify_forward = step, staticmethod(propose), forward


@contextlib.contextmanager
def sync_counter(device, counts: dict):
    """Count device-to-host syncs inside rounds (CUDA's sync debug mode; on the CPU, host reads of tensor values)."""
    import torch

    from hf_spec.engine.round import RoundEngine

    step, inside, caught = RoundEngine.step, [False], []  # caught: CUDA's sync warnings so far

    def counted_step(*args, **kwargs):
        inside[0], before = True, len(caught)
        counts["rounds"] = counts.get("rounds", 0) + 1
        try:
            return step(*args, **kwargs)
        finally:
            inside[0] = False
            found = sum("synchroniz" in str(w.message) for w in caught[before:])
            counts["syncs"] = counts.get("syncs", 0) + found

    def read_counted(real):
        def read(self, *a, **k):
            counts["syncs"] = counts.get("syncs", 0) + inside[0]
            return real(self, *a, **k)

        return read

    RoundEngine.step = counted_step
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}
    try:
        if device.type == "cuda":
            with warnings.catch_warnings(record=True) as records:
                warnings.simplefilter("always")
                caught = records  # the list the warnings go to, seen by counted_step
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    yield
                finally:
                    torch.cuda.set_sync_debug_mode(0)
        else:
            for name, real in originals.items():
                setattr(torch.Tensor, name, read_counted(real))
            yield
    finally:
        RoundEngine.step = step
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def oracle_decoder(model, ids, k: int, reference):
    from hf_spec import SpeculativeDecoder

    decoder = SpeculativeDecoder(f"oracle:{k}")
    decoder.drafter_for(model).set_reference(reference)
    return decoder


def loop_and_ceilings(model, ids, cfg: dict, backends: list[str], plain_s: float, verify_s: float) -> dict:
    """Per backend: the loop's own ms and syncs a round (oracle:8) and the oracle:k speedup ceilings."""
    new = cfg["new"]
    reference = model.generate(ids, max_new_tokens=new, do_sample=False)
    out, forced = {}, os.environ.get("HF_SPEC_BACKEND")
    for backend in backends:
        os.environ["HF_SPEC_BACKEND"] = backend
        k = min(8, max(cfg["ks"]))
        generate_seconds(model, ids, new, oracle_decoder(model, ids, k, reference))  # warm-up (kernel builds)
        totals: dict = {}
        with round_clock(model.device, totals):
            generate_seconds(model, ids, new, oracle_decoder(model, ids, k, reference))
        rounds = max(totals.get("round_calls", 0), 1)
        own = (totals["round"] - totals.get("forward", 0.0) - totals.get("propose", 0.0)) / rounds
        counts: dict = {}
        with sync_counter(model.device, counts):
            generate_seconds(model, ids, new, oracle_decoder(model, ids, k, reference))
        ceilings = {}
        for kk in cfg["ks"]:  # the faster of two runs: the first may compile kernels for this tree size
            seconds = min(
                generate_seconds(model, ids, new, oracle_decoder(model, ids, kk, reference)) for _ in "ab"
            )
            ceilings[kk] = plain_s / seconds
        out[backend] = {
            "loop_ms_per_round": 1e3 * own,
            "loop_share_of_verification": own / verify_s,
            "syncs_per_round": counts.get("syncs", 0) / max(counts.get("rounds", 1), 1),
            "oracle_speedup": ceilings,
        }
    os.environ.pop("HF_SPEC_BACKEND", None)
    if forced is not None:
        os.environ["HF_SPEC_BACKEND"] = forced
    return out


def replay(
    paths: list[str], layer_cost: dict, lm_cost: dict, layers: int, overhead: float, token_s: float
) -> dict:
    """Each recording's methods priced at these costs (`replay_speedup`) against `token_s` seconds a token."""
    from hf_spec.bench.rounds import paper_ratios, read_rounds, replay_speedup

    out = {}
    for path in paths:
        data = read_rounds(path)
        methods = data["methods"]
        recorded = data["num_layers"]  # the recorded target's layers: scaled to this target's `layers`
        results = {name: replay_speedup(e["rounds"], layer_cost, lm_cost, layers, overhead, token_s, recorded)
                   for name, e in methods.items()}  # fmt: skip
        ratios = paper_ratios({name: r["speedup"] for name, r in results.items()}, methods)
        machine = data.get("machine", {})
        out[Path(path).name] = {"recorded_on": data["target"], "recorded_machine": machine,
                                "methods": results, "ratios": ratios}  # fmt: skip
    return out


def check_shape(shape: str, device, dtype, cfg: dict, backends: list[str], args, budget) -> dict:
    """Every phase for one shape, in order of what matters most; a phase that cannot start before `budget`'s share
    for this shape (`until`) runs out is skipped and listed in `skipped`."""
    import torch

    from benchmarks import gpu_compiled as gc
    from benchmarks.gpu_kernels import kernel_pairs

    t0, until = time.perf_counter(), time.perf_counter() + budget.left() / args.shapes_left
    model = build_target(shape, device, dtype)
    ids = torch.randint(
        3, model.config.vocab_size, (1, cfg["context"]), generator=torch.Generator().manual_seed(0)
    )
    ids = ids.to(device)
    generate_seconds(model, ids, 4)
    plain_s, eager_tokens = gc.generate_tokens(model, ids, cfg["new"])
    result = {"shape": shape, "params_b": sum(p.numel() for p in model.parameters()) / 1e9,
              "plain_tokens_per_s": cfg["new"] / plain_s, "phase_seconds": {"build and plain": time.perf_counter() - t0},
              "skipped": []}  # fmt: skip

    def phase(name: str, need_s: float, fn, *fn_args):
        """Run `fn(*fn_args)` into `result[name]` if `need_s` seconds fit before `until`; errors are recorded."""
        if not budget.allows(need_s, until):
            result["skipped"].append(name)
            return None
        start = time.perf_counter()
        try:
            result[name] = fn(*fn_args)
        except Exception as e:  # a failed row is reported, the check goes on
            first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
            result[name] = {"error": f"{type(e).__name__}: {first}"}
        result["phase_seconds"][name] = time.perf_counter() - start
        print(f"{shape} {name}: {result['phase_seconds'][name]:.1f} s", flush=True)
        args.save(result)  # a run killed later keeps this phase
        return result[name]

    compiled = phase(
        "compiled_generate",
        budget.compile_guess_s,
        gc.compiled_generate,
        model,
        ids,
        cfg["new"],
        eager_tokens,
    )
    if compiled and "first_call_s" in compiled:
        budget.saw_compile(compiled["first_call_s"])
    costs = phase("verify", 0.0, verification_costs, model, ids, cfg["nodes"], cfg["reps"])
    forward, head = costs if isinstance(costs, tuple) else ({}, {})
    if forward:
        one = forward[1]
        result["verify_ms"] = {q - 1: 1e3 * s for q, s in forward.items()}
        result["verify_relative"] = {q - 1: s / one for q, s in forward.items()}
        result["lm_head_ms"] = {q: 1e3 * s for q, s in head.items()}
    else:  # the phases priced with the eager curve cannot run without it
        result["skipped"] += [
            "backends",
            *(["kernels"] if "triton" in backends else []),
            *(["replay"] if args.rounds else []),
        ]
    result.pop("verify", None)
    widths, reps, need = cfg["widths"], cfg["reps"] + 1, cfg["need_s"]
    # the compiled widths stop in time for the ceilings and kernel pairs
    reserve = need.get("backends", 0.0) + need.get("kernels", 0.0) if forward else 0.0
    static = phase("verify_static", budget.compile_guess_s + reserve, gc.static_verification_costs, model, ids,
                   widths, reps, budget, until - reserve)  # fmt: skip
    if forward:
        nine = forward[min(9, max(forward))]  # an oracle:8 verification
        loop = phase("backends", need.get("backends", 0.0), loop_and_ceilings, model, ids, cfg, backends, plain_s,
                     nine)  # fmt: skip
        if "triton" in backends:
            phase("kernels", need.get("kernels", 0.0), kernel_pairs, model, cfg)
        if args.rounds and loop and "error" not in loop:
            layers = model.config.num_hidden_layers
            overhead = loop[backends[-1]]["loop_ms_per_round"] / 1e3
            layer = {q: max(forward[q] - head[q], 0.0) / layers for q in forward}
            phase("replay", 0.0, replay, args.rounds, layer, head, layers, overhead, plain_s / cfg["new"])
            if static and static.get("compiled") and compiled and "tokens_per_s" in compiled:
                # a compiled round pads its tree to the next width; the LM head's rows cost what they cost eager
                from hf_spec.bench.rounds import interpolate

                bucket = gc.bucketed(static["compiled"], max(cfg["widths"]))
                layer_c = {q: max(s - interpolate(head, q), 0.0) / layers for q, s in bucket.items()}
                token_s = 1 / compiled["tokens_per_s"]
                phase("replay_compiled", 0.0, replay, args.rounds, layer_c, head, layers, overhead, token_s)
    if args.compile and compiled and "tokens_per_s" in compiled:
        reference = torch.cat([ids, torch.tensor([eager_tokens], device=device)], dim=1)
        seconds = cfg["new"] / compiled["tokens_per_s"]
        phase(
            "compiled_speculative",
            0.0,
            gc.compiled_speculative,
            model,
            ids,
            cfg["ks"],
            cfg["new"],
            reference,
            seconds,
        )
    result["seconds"] = time.perf_counter() - t0
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for gpu_check.json and gpu_check.md")
    parser.add_argument(
        "--rounds", nargs="*", default=[], help="`hf-spec bench --record-rounds` files to replay"
    )
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU check that the script works)")
    parser.add_argument("--shapes", default=None, help="comma list of 8b, 1b, tiny (default: 1b,8b; tiny)")
    parser.add_argument("--budget-s", type=float, default=570.0,
                        help="seconds for the whole run; phases that cannot fit are skipped and listed")  # fmt: skip
    parser.add_argument("--compile", action="store_true",
                        help="also run oracle:k with SpeculativeDecoder(..., compile=True), where it exists")  # fmt: skip
    args = parser.parse_args(argv)
    import torch

    from benchmarks import gpu_compiled as gc
    from benchmarks.gpu_report import markdown

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if (
        device.type == "cpu"
    ):  # the kernels run on CPU tensors under Triton's interpreter (set before its import)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from hf_spec.engine.backend import triton_available

    cfg = TINY if args.tiny else GPU
    budget = gc.Budget(args.budget_s, cfg["compile_guess_s"])
    shapes = (args.shapes or ("tiny" if args.tiny else "1b,8b")).split(",")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backends = ["torch", "triton"] if triton_available() else ["torch"]
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "dtype": str(dtype).removeprefix("torch."), "budget_s": args.budget_s,
              "compile": args.compile, "shapes": [], "skipped_shapes": []}  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save(partial: dict | None = None) -> None:
        """Write the report so far (with the shape being measured): a run cut short keeps what it measured."""
        done = {**report, "shapes": report["shapes"] + ([partial] if partial else [])}
        (out / "gpu_check.json").write_text(json.dumps(done, indent=1))
        (out / "gpu_check.md").write_text(markdown(done))

    args.save = save
    for i, shape in enumerate(shapes):
        if budget.left() <= 0:
            report["skipped_shapes"].append(shape)
            continue
        args.shapes_left = len(shapes) - i
        with gc.allow_recompiles():
            report["shapes"].append(check_shape(shape, device, dtype, cfg, backends, args, budget))
        print(f"{shape}: {report['shapes'][-1]['seconds']:.0f} s", flush=True)
        save()
    save()
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
