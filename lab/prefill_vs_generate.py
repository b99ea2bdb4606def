"""Training data per second: prefill-only features over fixed text against the generate-based path, side by side.

    python lab/prefill_vs_generate.py --target qwen2.5-coder-0.5b-instruct --dtype bfloat16 --threads 2 \\
        --corpus ~/.cache/hf-spec/corpus/v1/qwen2.5-coder-0.5b-instruct.jsonl \\
        --prompts ../shared/data/train/sharegpt_1000.json --out lab/results/prefill-vs-generate

Both paths end in the same store a head trains on (`hf-spec data features`): the target's unit-RMS states, its
top-K and, with `--aux-layers eagle3`, EAGLE-3's layers. The prefill path captures `--prefill-tokens` of the
corpus's fixed text (not its `answers`) in one teacher-forced forward per document; the generate path first has
the target answer `--generate-prompts` training prompts (greedy, batches of `--batch-size`, at most
`--max-new-tokens`; the prompts whose ids hash lowest, so both paths read a fixed sample) and then captures those
conversations. The figure that matters is trained tokens (those a head learns from) per second of the whole path.
Writes OUT/results.json and OUT/results.md with the command, machine and date.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # hf_spec from this checkout


def parse_args(argv: list[str]) -> argparse.Namespace:
    from hf_spec.cli.argtypes import positive_int

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--corpus", required=True, help="a corpus JSONL (scripts/build_corpus.py)")
    p.add_argument("--prompts", required=True, help="training prompts (ShareGPT .json or Alpaca .jsonl)")
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    p.add_argument("--threads", type=positive_int, default=2)
    p.add_argument("--aux-layers", default="eagle3", help="eagle3, or none")
    p.add_argument("--topk", type=positive_int, default=16)
    p.add_argument("--prefill-tokens", type=positive_int, default=30000)
    p.add_argument("--generate-prompts", type=positive_int, default=16)
    p.add_argument("--batch-size", type=positive_int, default=8)
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    return p.parse_args(argv)


def capture(model, sequences, topk: int, aux: tuple[int, ...]) -> tuple[float, int, int]:
    """Seconds to capture `sequences` into a fresh store, with their tokens and trained tokens."""
    from hf_spec.training.features import capture_sequences

    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        capture_sequences(model, sequences, tmp, topk=topk, aux_layers=aux, progress=False)
        seconds = time.perf_counter() - start
    return seconds, sum(len(s[1]) for s in sequences), sum(sum(s[2]) for s in sequences)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    from hf_spec.bench.machine import machine_info
    from hf_spec.models.fetch import load_model
    from hf_spec.training.corpus import read_documents
    from hf_spec.training.corpus_features import corpus_sequences, eagle3_layers, limited
    from hf_spec.training.prompts import load_train_prompts
    from hf_spec.training.responses import ResponseCache, generate_responses

    torch.set_num_threads(args.threads)
    model, tok = load_model(args.target, dtype=getattr(torch, args.dtype))
    aux = () if args.aux_layers == "none" else eagle3_layers(model.config.num_hidden_layers)
    eos = model.generation_config.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos)

    fixed = [d for d in read_documents(args.corpus) if not d.source.startswith("answers")]
    sequences = limited(corpus_sequences(fixed, tok, 1024, eos_ids), args.prefill_tokens)
    pre_s, pre_tokens, pre_trained = capture(model, sequences, args.topk, aux)

    prompts = sorted(load_train_prompts(args.prompts), key=lambda p: hashlib.sha1(p.id.encode()).hexdigest())
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        convs = generate_responses(
            model,
            tok,
            prompts[: args.generate_prompts],
            ResponseCache(tmp),
            batch_size=args.batch_size,
            max_new_tokens=args.max_new_tokens,
            progress=False,
        )
        gen_s = time.perf_counter() - start
    answer_tokens = sum(len(c.response_ids) for c in convs)
    items = [(c.id, c.input_ids, [0] * len(c.prompt_ids) + [1] * len(c.response_ids)) for c in convs]
    cap_s, _, _ = capture(model, items, args.topk, aux)

    prefill_rate = pre_trained / pre_s
    generate_rate = answer_tokens / (gen_s + cap_s)
    results = {
        "command": "python lab/prefill_vs_generate.py " + shlex.join(argv),
        "machine": machine_info() | {"torch_threads": args.threads},
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "dtype": args.dtype,
        "aux_layers": list(aux),
        "prefill": {
            "documents": len(sequences),
            "tokens": pre_tokens,
            "trained_tokens": pre_trained,
            "seconds": round(pre_s, 1),
            "trained_tokens_per_second": round(prefill_rate, 1),
        },
        "generate": {
            "prompts": len(convs),
            "answer_tokens": answer_tokens,
            "generate_seconds": round(gen_s, 1),
            "capture_seconds": round(cap_s, 1),
            "trained_tokens_per_second": round(generate_rate, 1),
        },
        "ratio": round(prefill_rate / generate_rate, 1),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    m, p, g = results["machine"], results["prefill"], results["generate"]
    (out / "results.md").write_text(
        "# Training data per second: prefill-only features vs the generate-based path\n\n"
        f"- Command: `{results['command']}`\n- Machine: {m['cpu']}, {m['cores']} cores, torch threads: "
        f"{args.threads}; torch {m['torch']}, transformers {m['transformers']}\n- Date: {results['date']}; "
        f"{args.dtype}, EAGLE-3 layers {list(aux) or 'none'}, top-{args.topk}\n\n"
        "| path | what | trained tokens | seconds | trained tokens/s |\n|---|---|---:|---:|---:|\n"
        f"| prefill | {p['documents']} fixed-text documents, {p['tokens']} tokens | {p['trained_tokens']} | "
        f"{p['seconds']} | {p['trained_tokens_per_second']} |\n"
        f"| generate | {g['prompts']} prompts answered (batches of {args.batch_size}, at most {args.max_new_tokens} "
        f"new tokens: {g['generate_seconds']} s), then captured ({g['capture_seconds']} s) | {g['answer_tokens']} | "
        f"{round(g['generate_seconds'] + g['capture_seconds'], 1)} | {g['trained_tokens_per_second']} |\n\n"
        f"Prefill gives {results['ratio']}x the trained tokens per second.\n"
    )
    print((out / "results.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
