"""Talon's bar from one `hf-spec bench` run: each hybrid's speedup over the better of its two halves (model-only
and retrieval-only), overall and per Spec-Bench group, how many groups reach `--bar`, and retrieval-only against
`hf-pld` on summarization and RAG. Speedups are the bench's own (`speedup_vs_ar`, `per_group`).

Usage: python lab/research/hybrid_table.py RESULTS.json --model-only METHOD [--model-only METHOD ...]
       --retrieval METHOD [--retrieval METHOD ...] [--hybrid METHOD ...] [--bar 1.1] [--out FILE.json]
(several --model-only: the better half is the best of them and the retrieval method, group by group)
(methods as the bench names them, e.g. `talon:benchmarks/configs/talon-<target>.json`; hybrids default to every
`talon:` method other than --model-only.)
"""

from __future__ import annotations

import argparse
import json

GROUPS = ("math_reasoning", "mt_bench", "qa", "rag", "summarization", "translation")


def hybrid_rows(summary: dict, hybrid: str, model_only: list[str], retrieval: str, bar: float) -> dict:
    """Speedup of `hybrid` over the best of the `model_only` methods and `retrieval`, overall and per group, and
    the groups at `bar`."""
    halves = [summary[m] for m in model_only] + [summary[retrieval]]
    overall = summary[hybrid]["speedup_vs_ar"] / max(h["speedup_vs_ar"] for h in halves)
    groups = {g: summary[hybrid]["per_group"][g] / max(h["per_group"][g] for h in halves) for g in GROUPS}
    return {"overall": round(overall, 3), **{g: round(r, 3) for g, r in groups.items()},
            "groups_at_bar": sum(r >= bar for r in groups.values())}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("results")
    ap.add_argument("--model-only", action="append", required=True)
    ap.add_argument("--retrieval", action="append", required=True)
    ap.add_argument("--hybrid", action="append", default=None)
    ap.add_argument("--bar", type=float, default=1.1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    with open(args.results) as f:
        summary = json.load(f)["summary"]
    hybrids = args.hybrid or [m for m in summary if m.startswith("talon:") and m not in args.model_only]
    for name in [*args.model_only, *args.retrieval, *hybrids]:
        if name not in summary:
            raise SystemExit(f"{name!r} is not in {args.results}; it has: {', '.join(summary)}")
    report = {}
    print(f"| hybrid | retrieval half | overall | {' | '.join(GROUPS)} | groups >= {args.bar} |")
    print("|---|---|---|" + "---|" * len(GROUPS) + "---|")
    for retrieval in args.retrieval:
        for hybrid in hybrids:
            row = hybrid_rows(summary, hybrid, args.model_only, retrieval, args.bar)
            report[f"{hybrid} / {retrieval}"] = row
            print(f"| {hybrid} | {retrieval} | {row['overall']:.3f} | "
                  f"{' | '.join(f'{row[g]:.3f}' for g in GROUPS)} | {row['groups_at_bar']} |")  # fmt: skip
    if "hf-pld" in summary:
        pld = summary["hf-pld"]["per_group"]
        for retrieval in args.retrieval:
            own = summary[retrieval]["per_group"]
            report[f"{retrieval} / hf-pld"] = {g: round(own[g] / pld[g], 3) for g in ("summarization", "rag")}
            print(f"{retrieval} / hf-pld: summarization {own['summarization'] / pld['summarization']:.3f}, "
                  f"rag {own['rag'] / pld['rag']:.3f}")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
