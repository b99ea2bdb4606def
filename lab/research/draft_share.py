"""How much of a bench run's time is drafting, and how fast each method would be if its drafting (and its loop
bookkeeping) cost nothing: an upper bound on what a cheaper drafter of the same acceptance could gain.

From a `hf-spec bench` results.json (its per-prompt stats): per method, tokens / seconds summed over the prompts,
the share of the time spent drafting, tokens / (seconds - draft time) ("drafting free") and tokens /
(verification + prefill time) ("verification only"), each also against a reference method's measured rate.

Usage: python lab/research/draft_share.py RESULTS.json [--reference eagle:...hass...] [--out FILE]
"""

from __future__ import annotations

import argparse
import json


def shares(results: dict) -> dict[str, dict]:
    out = {}
    for name in results["summary"]:
        runs = [r for r in results["runs"] if r["method"] == name]
        if not runs or any("stats" not in r for r in runs):
            continue
        tokens = sum(r["new_tokens"] for r in runs)
        seconds = sum(r["seconds"] for r in runs)
        stat = {k: sum(r["stats"][k] for r in runs) for k in ("time_draft", "time_verify", "time_prefill")}
        out[name] = {
            "tokens": tokens,
            "tokens_per_s": tokens / seconds,
            "tau": results["summary"][name]["tau"],
            "draft_share": stat["time_draft"] / seconds,
            "drafting_free": tokens / (seconds - stat["time_draft"]),
            "verification_only": tokens / (stat["time_verify"] + stat["time_prefill"]),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("results")
    ap.add_argument(
        "--reference", default=None, help="method to compare with (default: the first eagle: one)"
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    with open(args.results) as f:
        results = json.load(f)
    rows = shares(results)
    if not rows:
        raise SystemExit(f"{args.results}: no method with per-prompt stats (a bench run of `ar` only?)")
    ref = args.reference or next((m for m in rows if m.startswith("eagle:")), next(iter(rows)))
    if ref not in rows:
        raise SystemExit(
            f"--reference {ref!r} is not a method of {args.results} with stats: {', '.join(rows)}"
        )
    base = rows[ref]["tokens_per_s"]
    print(f"reference: `{ref}` {base:.1f} tok/s")
    print("| method | tau | tok/s | draft share | tok/s, drafting free | tok/s, verification only | "
          "measured / ref | drafting free / ref | verification only / ref |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        for key in ("tokens_per_s", "drafting_free", "verification_only"):
            r[f"{key}_vs_reference"] = r[key] / base
        print(f"| `{name}` | {r['tau']:.2f} | {r['tokens_per_s']:.1f} | {r['draft_share']:.0%} | "
              f"{r['drafting_free']:.1f} | {r['verification_only']:.1f} | {r['tokens_per_s_vs_reference']:.2f} | "
              f"{r['drafting_free_vs_reference']:.2f} | {r['verification_only_vs_reference']:.2f} |")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"results": args.results, "reference": ref, "methods": rows}, f, indent=1)


if __name__ == "__main__":
    main()
