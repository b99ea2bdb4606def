"""The GPU training check: feature capture and head training timed on a GPU, and the heads trained there decoding
losslessly there, through the commands a user runs.

    python benchmarks/gpu_train_check.py --out DIR --target FOLDER [--target FOLDER ...] --corpus FILE.jsonl \
        [--limit-tokens N] [--work DIR]

A target FOLDER needs its `config.json` and tokenizer files only: its weights are made random (seed 0) on the
device, so no checkpoint travels; what capture and training cost depends on the shapes, not on the weights. For each
target, in a work folder (default: a temporary one), it times

1. `hf-spec data features --corpus FILE --aux-layers eagle3 --dtype bfloat16` (prefill only) over the corpus' first
   `--limit-tokens` tokens, once for each `--docs-per-forward` value (documents in one forward), each into its own
   store;
2. `hf-spec train eagle3` (3 training-time-test steps, top-10 distillation, a 16,384-token draft vocabulary: the
   committed heads' recipe) and `hf-spec train eagle --align-steps 3 --topk 10` (HASS) on that store, one epoch;
3. `hf-spec bench --check-lossless` of plain decoding and both trained heads, in float32 (every token must equal plain
   `generate`'s), on documents of the corpus past the captured ones;

and writes `DIR/gpu_train_check.json` and `DIR/gpu_train_check.md`. Each step has its own time limit
(`--step-seconds`), so a slow one cannot starve the next; a capture cut short leaves a smaller store the training
steps still use. On a CPU (`--device cpu`) with a tiny target it keeps working in CI.
"""

from __future__ import annotations

import argparse
import json
import pstats
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # hf_spec from this checkout, installed or not
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "chat_template.jinja",
                   "special_tokens_map.json", "vocab.json", "merges.txt", "generation_config.json")  # fmt: skip
HEADS = {  # name -> (trainer, its arguments): the recipe of scripts/train_heads.sh, one epoch
    "eagle3": ("eagle3", ["--align-steps", "3", "--topk", "10", "--draft-vocab", "16384"]),
    "hass": ("eagle", ["--align-steps", "3", "--topk", "10", "--init-from-last-layer"]),
}


# what the check keeps of each head's training_report.json and of the bench's results.json summary
REPORTED = ("tokens_per_second", "wall_seconds", "steps", "tokens_seen", "train_tokens")
BENCHED = ("speedup_vs_ar", "tau", "tokens_per_s", "lossless_mismatches", "near_tie_mismatches")


def random_target(config_folder: Path, out: Path, device: str) -> dict:
    """A random-weight copy of the target described by `config_folder` (config and tokenizer) saved to `out`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_folder)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (config_folder / name).exists():
            shutil.copy(config_folder / name, out / name)
    params = sum(p.numel() for p in model.parameters())
    del model
    return {"parameters": params, "layers": config.num_hidden_layers, "hidden": config.hidden_size,
            "vocab": config.vocab_size}  # fmt: skip


def run_step(name: str, argv: list[str], log: Path, seconds: float, profile: Path | None = None) -> dict:
    """Run `hf-spec ARGV` with a time limit; its output goes to `log`. Returns rc, seconds and whether it timed out.
    With `profile`, the step runs under cProfile and its 30 costliest functions are appended to that file."""
    prof = log.with_suffix(".prof")
    command = [
        sys.executable,
        *(["-m", "cProfile", "-o", str(prof)] if profile else []),
        "-m",
        "hf_spec.cli.main",
    ]
    began = time.perf_counter()
    with log.open("w") as f:
        try:
            rc = subprocess.run([*command, *argv], stdout=f, stderr=subprocess.STDOUT, timeout=seconds,
                                cwd=REPO).returncode  # fmt: skip
            timed_out = False
        except subprocess.TimeoutExpired:
            rc, timed_out = None, True
    took = round(time.perf_counter() - began, 1)
    print(f"{name}: rc {rc}{' (time limit)' if timed_out else ''}, {took} s", flush=True)
    if rc not in (0, None):
        print("".join(log.read_text().splitlines(keepends=True)[-15:]), flush=True)
    if profile and prof.exists():  # cProfile writes it at a normal exit only
        with profile.open("a") as f:
            f.write(f"\n## {log.parent.name}: {name} ({took} s)\n")
            pstats.Stats(str(prof), stream=f).sort_stats("tottime").print_stats(30)
    return {"rc": rc, "seconds": took, "timed_out": timed_out}


def bench_prompts(corpus: Path, count: int, out: Path) -> Path:
    """Spec-Bench rows from the first user turns of the corpus' last `count` documents (past the captured ones)."""
    from hf_spec.training.corpus import load_corpus

    firsts = [
        next((text for role, text in doc.messages if role == "user"), "") for doc in load_corpus(corpus)
    ]
    turns = [text[:2000] for text in reversed(firsts) if text.strip()][:count]
    rows = [{"question_id": i + 1, "category": "corpus", "turns": [text]} for i, text in enumerate(turns)]
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def logged_rate(log: Path) -> float | None:
    """The capture's own tokens/s (its last `--log` line: the forwards and writes, not loading the target)."""
    rates = re.findall(r"([0-9.]+) tokens/s this run", log.read_text()) if log.exists() else []
    return float(rates[-1]) if rates else None


def check_target(folder: Path, args, work: Path) -> dict:
    """Capture, train both heads and bench them for the target `folder` (config + tokenizer) in `work`."""
    from hf_spec.training.features import FeatureStore

    work.mkdir(parents=True, exist_ok=True)
    target, store, progress = work / "target", work / "store", work / "capture-progress.log"
    result: dict = {"target": folder.name, "shape": random_target(folder, target, args.device)}

    def step(name: str, argv: list[str], log: str) -> dict:
        common = ["--target", str(target), "--device", args.device]
        return run_step(name, [*argv, *common], work / log, args.step_seconds, args.profile_file)

    for n, batch in enumerate(args.docs_per_forward):  # the first store is the one the heads train on
        folder, log = (
            (store, progress) if n == 0 else (work / f"store-{batch}", work / f"capture-{batch}.log")
        )
        capture = step(f"capture, {batch} a forward", ["data", "features", "--corpus", str(args.corpus),
                       "--features-dir", str(folder), "--aux-layers", args.aux_layers, "--dtype", "bfloat16",
                       "--limit-tokens", str(args.limit_tokens), "--min-free-gb", "1", "--log", str(log),
                       "--docs-per-forward", str(batch)], f"capture-{batch}.out")  # fmt: skip
        tokens = FeatureStore.open(
            folder
        ).num_tokens  # what was captured, also when the time limit cut it short
        capture |= {"docs_per_forward": batch, "tokens": tokens, "tokens_per_second": logged_rate(log)}
        result.setdefault("captures", []).append(capture)
    result["capture"] = result["captures"][0]
    heads = []
    for name, (trainer, extra) in HEADS.items():
        out = work / name
        result[name] = step(f"train {name}", ["train", trainer, "--features", str(store), "--epochs", "1",
                                              "--batch-tokens", str(args.batch_tokens), "--heldout",
                                              str(args.heldout), "--out", str(out), "--checkpoint-dir",
                                              str(work / f"{name}-run"), *extra], f"{name}.log")  # fmt: skip
        if (out / "training_report.json").exists():
            report = json.loads((out / "training_report.json").read_text())
            result[name] |= {key: report.get(key) for key in REPORTED}
            result[name]["heldout_by_depth"] = report.get("heldout", {}).get("accuracy_by_depth")
            heads.append(str(out))
    prompts = bench_prompts(args.corpus, args.bench_prompts, work / "prompts.jsonl")
    bench = step("bench", ["bench", "--methods", ",".join(["ar", *heads]), "--prompts", str(prompts),
                           "--max-new-tokens", str(args.new_tokens), "--dtype", "float32", "--check-lossless",
                           "--out", str(work / "bench")], "bench.log")  # fmt: skip
    if (work / "bench" / "results.json").exists():
        summary = json.loads((work / "bench" / "results.json").read_text())["summary"]
        bench["methods"] = {Path(m).name: {key: s.get(key) for key in BENCHED} for m, s in summary.items()}
    result["bench"] = bench
    return result


def trained(step: dict) -> str:
    """A training step's table cell: trained tokens/s (wall seconds), or why there is none."""
    if step.get("rc") == 0:
        return f"{step.get('tokens_per_second')} ({step.get('wall_seconds')})"
    return "time limit" if step.get("timed_out") else f"failed (rc {step.get('rc')})"


def markdown(results: list[dict], machine: dict) -> str:
    lines = [f"# GPU training check: {machine['device']}", "", f"{machine['versions']}; {machine['date']}", "",
             "Random-weight targets of the real shapes (what capture and training cost, not what the heads learn).",
             "", "| target | capture tok/s (tokens; other documents a forward) | EAGLE-3 trained tok/s (s) | "
             "HASS trained tok/s (s) | lossless "
             "(float32): mismatches, tau |", "|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        bench = r.get("bench", {}).get("methods", {})
        lossless = "; ".join(f"{m}: {b['lossless_mismatches']}, tau {b['tau']:.2f}" for m, b in bench.items()
                             if m != "ar") or f"bench rc {r.get('bench', {}).get('rc')}"  # fmt: skip
        cap = r["capture"]
        others = "".join(
            f"; {c['docs_per_forward']} a forward: {c['tokens_per_second']}" for c in r["captures"][1:]
        )
        lines.append(f"| {r['target']} ({r['shape']['parameters'] / 1e6:.0f}M) | {cap['tokens_per_second']} "
                     f"({cap['tokens']}{others}) | {trained(r.get('eagle3', {}))} | {trained(r.get('hass', {}))} | "
                     f"{lossless} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def machine_facts(device: str) -> dict:
    import torch
    import transformers

    name = torch.cuda.get_device_name() if device.startswith("cuda") else "CPU"
    return {"device": name, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "versions": f"torch {torch.__version__}, transformers {transformers.__version__}"}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument(
        "--target", action="append", required=True, type=Path, help="config + tokenizer folder"
    )
    parser.add_argument("--corpus", required=True, type=Path, help="corpus JSONL (scripts/build_corpus.py)")
    parser.add_argument("--limit-tokens", type=int, default=400_000)
    parser.add_argument(
        "--aux-layers", default="eagle3", help="the layers EAGLE-3 reads (data features' option)"
    )
    parser.add_argument(
        "--docs-per-forward",
        type=lambda v: [int(n) for n in v.split(",")],
        default=[1],
        help="comma list: capture once per value (documents in one forward); the heads train on the first store",
    )
    parser.add_argument("--batch-tokens", type=int, default=4096)
    parser.add_argument("--heldout", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--bench-prompts", type=int, default=6)
    parser.add_argument("--step-seconds", type=float, default=150.0)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--work", type=Path, help="default: a temporary folder, removed afterwards")
    parser.add_argument("--profile", action="store_true", help="each step under cProfile: DIR/profile.txt")
    args = parser.parse_args(argv)
    args.profile_file = args.out / "profile.txt" if args.profile else None
    args.out.mkdir(parents=True, exist_ok=True)
    machine = machine_facts(args.device)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        for folder in args.target:
            results.append(check_target(folder, args, work / folder.name))
            report = {"machine": machine, "command": " ".join(sys.argv), "results": results}
            (args.out / "gpu_train_check.json").write_text(json.dumps(report, indent=1) + "\n")
            (args.out / "gpu_train_check.md").write_text(markdown(results, machine))
    print((args.out / "gpu_train_check.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
