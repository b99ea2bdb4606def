"""The GPU check: one command that measures what hf-spec's loop costs on a GPU (the 1B shape: ~2.5 min on an H200).

    python benchmarks/gpu_check.py --out DIR [--rounds FILE ...]   # FILE: `hf-spec bench --record-rounds FILE`
    python benchmarks/gpu_check.py --out DIR --tiny       # CPU, tiny shapes, Triton's interpreter: keeps it working

Random-weight targets of real shapes are built on the device (Llama-3.1-8B- and Llama-3.2-1B-shaped, bfloat16,
sdpa; on the meta device first, then filled there: nothing is downloaded). For each it measures and writes
`DIR/gpu_check.json` and `DIR/gpu_check.md`:

- plain `generate` tokens/s;
- verification cost of 0, 1, 2, 4, ..., 64 tree nodes relative to one step (a one-token forward);
- the loop's own time a round (outside the drafter and the target's forward) and its device-to-host syncs a round
  (`torch.cuda.set_sync_debug_mode` on CUDA, host reads of tensor values on the CPU), torch and triton backends;
- `oracle:k` speedup ceilings, k = 2..16, both backends;
- each Triton kernel against its torch twin (milliseconds, max error) at the round's real sizes;
- a replay of recorded rounds (`hf-spec bench --record-rounds FILE`): each method's speedup at this target's
  costs (`hf_spec.bench.rounds.replay_speedup`) and the three paper ratios (Lyanna / HASS head, HiSpec / best
  single exit, Talon / its better half).
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

SHAPES = {  # the configs of the real models, without their weights
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1000),
}  # fmt: skip
GPU = dict(
    context=512, new=128, ks=list(range(2, 17)), nodes=[0, 1, 2, 4, 8, 16, 32, 64], reps=5, kernel_nodes=64
)
TINY = dict(context=24, new=12, ks=[2, 4], nodes=[0, 1, 2, 4], reps=1, kernel_nodes=8)
HOST_READS = ("tolist", "item", "__int__", "__float__", "__bool__")
PAPER_CLAIMS = {  # `hf_spec.bench.rounds.paper_ratios` keys: the claim and the ratio its paper measured on GPUs
    "lyanna_vs_hass": ("Lyanna / the HASS head", 1.2),
    "hispec_vs_best_exit": ("HiSpec / the best single exit", 1.25),
    "talon_vs_better_half": ("Talon's hybrid / its better half", 1.1),
}


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


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, reps: int) -> float:
    """Median seconds of `fn()` over `reps` runs after one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


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


def replay(
    paths: list[str], layer_cost: dict, lm_cost: dict, layers: int, overhead: float, token_s: float
) -> dict:
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


def check_shape(shape: str, device, dtype, cfg: dict, backends: list[str], rounds: list[str]) -> dict:
    import torch

    t0 = time.perf_counter()
    model = build_target(shape, device, dtype)
    ids = torch.randint(
        3, model.config.vocab_size, (1, cfg["context"]), generator=torch.Generator().manual_seed(0)
    )
    ids = ids.to(device)
    generate_seconds(model, ids, 4)
    plain_s = generate_seconds(model, ids, cfg["new"])
    forward, head = verification_costs(model, ids, cfg["nodes"], cfg["reps"])
    one = forward[1]
    layer = {q: max(forward[q] - head[q], 0.0) / model.config.num_hidden_layers for q in forward}
    nine = forward[min(9, max(forward))]  # an oracle:8 verification
    loop = loop_and_ceilings(model, ids, cfg, backends, plain_s, nine)
    result = {
        "shape": shape, "params_b": sum(p.numel() for p in model.parameters()) / 1e9,
        "plain_tokens_per_s": cfg["new"] / plain_s,
        "verify_ms": {q - 1: 1e3 * s for q, s in forward.items()},
        "verify_relative": {q - 1: s / one for q, s in forward.items()},
        "lm_head_ms": {q: 1e3 * s for q, s in head.items()},
        "backends": loop,
    }  # fmt: skip
    if "triton" in backends:
        result["kernels"] = kernel_pairs(model, cfg)
    if rounds:
        overhead = loop[backends[-1]]["loop_ms_per_round"] / 1e3
        result["replay"] = replay(
            rounds, layer, head, model.config.num_hidden_layers, overhead, plain_s / cfg["new"]
        )
    result["seconds"] = time.perf_counter() - t0
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def markdown(report: dict) -> str:
    """The report as markdown tables, one section a shape."""
    from hf_spec.bench.plots import short_label

    lines = [f"# GPU check: {report['device']}", "", f"torch {report['torch']}, dtype {report['dtype']}", ""]
    for r in report["shapes"]:
        lines += [f"## {r['shape']} ({r['params_b']:.2f}B parameters, random weights)", "",
                  f"plain `generate`: {r['plain_tokens_per_s']:.1f} tokens/s", "",
                  "| tree nodes | " + " | ".join(map(str, r["verify_relative"])) + " |",
                  "|---|" + "---|" * len(r["verify_relative"]),
                  "| cost / one step | " + " | ".join(f"{v:.2f}" for v in r["verify_relative"].values()) + " |", "",
                  "| backend | loop ms/round | share of a 9-token verification | syncs/round | oracle:k speedup |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for name, b in r["backends"].items():
            ks = ", ".join(f"{k}: {s:.2f}x" for k, s in b["oracle_speedup"].items())
            lines.append(f"| {name} | {b['loop_ms_per_round']:.3f} | {b['loop_share_of_verification']:.1%} | "
                         f"{b['syncs_per_round']:.2f} | {ks} |")  # fmt: skip
        if "kernels" in r:
            lines += [
                "",
                "| kernel | Triton ms | torch twin ms | speedup | max error |",
                "|---|---|---|---|---|",
            ]
            lines += [f"| {k} | {v['kernel_ms']:.3f} | {v['torch_ms']:.3f} | {v['speedup']:.2f}x | {v['max_error']:.2g} |"
                      for k, v in r["kernels"].items()]  # fmt: skip
        for file, rep in r.get("replay", {}).items():
            where = rep["recorded_machine"].get("cpu", "")
            lines += ["", f"Replay of `{file}` (rounds of {rep['recorded_on']}, recorded on {where or 'a CPU'}):",
                      "", "| method | tau | speedup at these costs |", "|---|---|---|"]  # fmt: skip
            target = Path(rep["recorded_on"]).name
            for name, m in rep["methods"].items():
                speed = f"{m['speedup']:.2f}x" if m["speedup"] else "n/a"
                lines.append(f"| {short_label(name, target)} | {m['tau'] or 0:.2f} | {speed} |")
            lines += ["", "| paper claim | measured there | ratio here |", "|---|---|---|"]
            lines += [f"| {PAPER_CLAIMS[k][0]} | >= {PAPER_CLAIMS[k][1]}x | {f'{v:.2f}x' if v else 'n/a'} |"
                      for k, v in rep["ratios"].items()]  # fmt: skip
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for gpu_check.json and gpu_check.md")
    parser.add_argument(
        "--rounds", nargs="*", default=[], help="`hf-spec bench --record-rounds` files to replay"
    )
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU check that the script works)")
    parser.add_argument("--shapes", default=None, help="comma list of 8b, 1b, tiny (default: 8b,1b; tiny)")
    args = parser.parse_args(argv)
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if (
        device.type == "cpu"
    ):  # the kernels run on CPU tensors under Triton's interpreter (set before its import)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from hf_spec.engine.backend import triton_available

    cfg = TINY if args.tiny else GPU
    shapes = (args.shapes or ("tiny" if args.tiny else "8b,1b")).split(",")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backends = ["torch", "triton"] if triton_available() else ["torch"]
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "dtype": str(dtype).removeprefix("torch."), "shapes": []}  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for shape in shapes:  # the report is written after each shape: a run cut short keeps what it measured
        report["shapes"].append(check_shape(shape, device, dtype, cfg, backends, args.rounds))
        print(f"{shape}: {report['shapes'][-1]['seconds']:.0f} s", flush=True)
        (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
        (out / "gpu_check.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
