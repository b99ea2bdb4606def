"""The ceiling of any Talon switch on this machine: an oracle that knows every round's outcome in advance, against
the better of retrieval-only and model-only drafting, from measured acceptance and measured costs.

1. Greedy continuations of Spec-Bench prompts (`--per-category` of each category).
2. At every position: what the retrieval tree (the Talon config's retriever on the true context) gets accepted
   (R), what the model drafter's chain gets accepted (M: the int8 layer-22 exit chain of `--model-drafts` tokens,
   from one teacher-forced forward), and what a fused tree gets accepted: max(R, M), or with Talon's extension
   (retrieval continuing a fully accepted model chain) 2 + what retrieval gets accepted after it, capped at
   `extend_tokens`. A fused tree pays its retrieval nodes capped at `both_nodes` but is credited the uncapped
   tree's acceptance (in the hybrid's favour).
3. Costs timed in hf-spec's loop settings: a retrieval lookup (mean of the real calls), a model draft step (int8
   copies of layers [0, 22) + the exit head), a verification of n nodes (chain, screened LM head), n = 1..40.
4. Retrieval-only, model-only and always-both replayed round by round; the oracle switch by dynamic programming
   (least total time over the three choices at every round). Ratios per Spec-Bench group and overall.
5. The same replay under two what-if cost models (`WHAT_IFS`): every verification priced as one node (a memory-bound
   accelerator at batch 1, where a fused tree costs what either half costs), and that with model drafting free too
   (drafting wholly overlapped with verification, Talon's asynchronous ideal).

Usage: python lab/research/talon_bound.py [--dtype bfloat16] [--per-category 1] [--max-new-tokens 96]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

import numpy as np
import torch
from hispec_bound import context_cache, draft_step, greedy_continuations, timed, verification

from hf_spec.bench.runner import spec_bench_group
from hf_spec.core.config import read_config
from hf_spec.kernels.grouped_attention import grouped_attention
from hf_spec.methods.early_exit.drafter import quantize_draft_layers
from hf_spec.methods.early_exit.exit_heads import load_exit_lm
from hf_spec.methods.retrieval.config import RetrievalConfig
from hf_spec.methods.retrieval.retriever import Retriever
from hf_spec.models import load_model
from hf_spec.models.layers import decoder_parts


def accepted_in_tree(tree, truth: list[int]) -> int:
    """Longest root path of `tree` whose tokens are a prefix of `truth`."""
    best, depth_of = 0, {-1: 0}
    for i, (tok, parent) in enumerate(zip(tree.tokens.tolist(), tree.parents.tolist(), strict=True)):
        d = depth_of.get(parent)
        if d is not None and d < len(truth) and truth[d] == tok:
            depth_of[i] = d + 1
            best = max(best, d + 1)
    return best


def costs_of(model, exits, quantized, context_ids, layer: int, max_nodes: int, reps: int) -> dict:
    """ms of a model draft step (packed layers [0, `layer`) + exit) and of verifications of 1..`max_nodes` rows."""
    cache, _ = context_cache(model, context_ids)
    with torch.no_grad(), grouped_attention(model):
        costs = {"step": timed(draft_step(model, cache, context_ids, layer, quantized, exits), reps)}
        verify = [timed(verification(model, cache, context_ids, n), reps) for n in range(1, max_nodes + 1)]
    costs["verify"] = [0.0, *verify]
    return costs


def tree_shape(tree) -> tuple[int, int, int]:
    """(first token of the most frequent path or -1, number of distinct first tokens, depth of that path)."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    firsts = [i for i, parent in enumerate(parents) if parent == -1]
    if not firsts:
        return -1, 0, 0
    node, depth = firsts[0], 1
    while kids := [i for i, parent in enumerate(parents) if parent == node]:
        node, depth = kids[0], depth + 1
    return tokens[firsts[0]], len(firsts), depth


def drafter_outcomes(
    model, tok, retriever, exits, layer: int, n_model: int, args
) -> tuple[list[dict], list[float]]:
    """Per greedy continuation (`args.prompts`, `args.per_category`, `args.max_new_tokens`): at every root
    position t, what the retrieval tree gets accepted (with its match length, size and shape) and what the model's
    chain of `n_model` exit drafts gets accepted, the exit's argmax and confidence; and every lookup's ms."""
    rows, lookup_ms = [], []
    for p, out, start in greedy_continuations(
        model, tok, args.prompts, args.max_new_tokens, args.per_category
    ):
        with torch.no_grad():
            hidden = model(out, output_hidden_states=True).hidden_states[layer]
            probs = exits.logits(layer, hidden[:, start:])[0].float().softmax(-1).max(-1)
        drafts, confidence, seq = probs.indices.tolist(), probs.values.tolist(), out[0].tolist()
        n_pos = len(seq) - start
        truth = [seq[start + t + 1 :] for t in range(n_pos)]
        retrieval = []
        for t in range(n_pos):
            c = time.perf_counter()
            tree, match = retriever.propose(np.asarray(seq[: start + t + 1]), max_depth=64)
            lookup_ms.append(1000 * (time.perf_counter() - c))
            first, n_first, depth = tree_shape(tree)
            retrieval.append({"accepted": accepted_in_tree(tree, truth[t]), "nodes": len(tree), "match": match,
                              "first": first, "n_first": n_first, "depth": depth})  # fmt: skip
        model_acc = []
        for t in range(n_pos):
            m = 0
            while m < n_model and t + m < n_pos - 1 and drafts[t + m] == truth[t + m][0]:
                m += 1
            model_acc.append(m)
        rows.append({"group": spec_bench_group(p.category), "seq": seq, "n_pos": n_pos, "retrieval": retrieval,
                     "model_acc": model_acc, "drafts": drafts, "confidence": confidence, "truth": truth})  # fmt: skip
    print(f"{len(rows)} continuations", flush=True)
    return rows, lookup_ms


def measured_costs(model, exit_heads: str, seq: list[int], layer: int, context: int, reps: int) -> dict:
    """`costs_of` after a context of `context` tokens (`seq` repeated), on int8 copies of the drafting layers."""
    context_ids = torch.tensor([seq * (1 + context // len(seq))])[:, :context]
    packed_exits = load_exit_lm(model, exit_heads, draft_vocab=True)
    quantized = quantize_draft_layers(decoder_parts(model), layer, "int8", packed_exits)
    return costs_of(model, packed_exits, quantized, context_ids, layer, 40, reps)


class RoundCosts:
    """Each choice's (accepted tokens, ms) at root position t of a `drafter_outcomes` row, from measured costs:
    retrieval alone, the model's chain alone, or both fused (Talon's extension after a fully accepted chain; the
    fused tree pays its retrieval nodes capped at `both_nodes` but is credited the uncapped tree's acceptance).
    What-ifs: `flat_verify` prices every verification as one node (hardware where a small tree is memory-bound, as a
    GPU at batch 1); `free_draft` prices model drafting at 0 (drafting wholly hidden behind verification)."""

    def __init__(
        self, costs: dict, n_model: int, talon: dict, flat_verify: bool = False, free_draft: bool = False
    ) -> None:
        self.costs, self.n_model = costs, n_model
        fusion = talon.get("fusion") or talon  # a config's `fusion` part (flat in older configs)
        self.extend = int(fusion.get("extend_tokens", 0))
        self.both_nodes = int(fusion.get("both_nodes", 0) or 10**6)
        self.flat_verify, self.free_draft = flat_verify, free_draft

    def verify(self, nodes: int) -> float:
        return self.costs["verify"][1 if self.flat_verify else min(nodes, 40)]

    def options(self, row: dict, t: int) -> dict[str, tuple[int, float]]:
        ret, n = row["retrieval"][t], self.n_model
        r, nodes, m = ret["accepted"], ret["nodes"], row["model_acc"][t]
        lookup, draft = self.costs["lookup"], 0.0 if self.free_draft else n * self.costs["step"]
        fused = max(r, m)
        if self.extend and m == n and t + m < row["n_pos"] - 1:
            fused = max(fused, m + min(row["retrieval"][t + m]["accepted"], self.extend))
        return {
            "retrieval": (r, lookup + self.verify(nodes + 1)),
            "model": (m, draft + self.verify(n + 1)),
            "both": (fused, lookup + draft + self.verify(min(nodes, self.both_nodes) + n + self.extend + 1)),
        }


def replay(options_at, n_pos: int, choose) -> tuple[float, int]:
    """(ms, rounds) of committing positions 0..n_pos-1 choosing at each round with `choose(options) -> option`;
    an option is (accepted, ms)."""
    t = ms = rounds = 0
    while t < n_pos - 1:
        acc, cost = choose(options_at(t))
        ms, rounds, t = ms + cost, rounds + 1, t + acc + 1
    return ms, rounds


def oracle(options_at, n_pos: int) -> float:
    """Least total ms over every sequence of choices (dynamic programming from the end)."""
    best = [0.0] * (n_pos + 64)
    for t in range(n_pos - 2, -1, -1):
        best[t] = min(cost + best[min(t + acc + 1, n_pos - 1)] for acc, cost in options_at(t))
    return best[0]


CHOICES = ("retrieval", "model", "both")
WHAT_IFS = {"flat verification": (True, False), "flat verification, drafting free": (True, True)}


def choice_totals(rows: list[dict], rounds: RoundCosts) -> defaultdict:
    """Per Spec-Bench group and "all": ms and rounds of each fixed choice in `CHOICES` (keys `choice`,
    `choice rounds`), ms of the oracle switch, and committed tokens."""
    totals = defaultdict(lambda: defaultdict(float))
    for row in rows:
        n_pos = row["n_pos"]

        def options(t, row=row):
            return rounds.options(row, t)

        for choice in CHOICES:
            ms, n_rounds = replay(lambda t, choice=choice: [options(t)[choice]], n_pos, lambda o: o[0])
            for key in (row["group"], "all"):
                totals[key][choice] += ms
                totals[key][choice + " rounds"] += n_rounds
        ms = oracle(lambda t: list(options(t).values()), n_pos)
        for key in (row["group"], "all"):
            totals[key]["oracle"] += ms
            totals[key]["tokens"] += n_pos - 1
    return totals


def what_if_rates(rows: list[dict], costs: dict, n_model: int, talon: dict) -> dict[str, dict[str, dict]]:
    """Per `WHAT_IFS` cost model, per Spec-Bench group and "all": tokens/s of retrieval, model, always-both and the
    oracle switch, mean accepted tokens a round of each fixed choice (`tau`), and both's and the oracle's ratio to
    the better half."""
    report = {}
    for name, (flat_verify, free_draft) in WHAT_IFS.items():
        totals = choice_totals(rows, RoundCosts(costs, n_model, talon, flat_verify, free_draft))
        report[name] = {}
        for key, tot in totals.items():
            rate = {c: tot["tokens"] / tot[c] * 1000 for c in ("retrieval", "model", "both", "oracle")}
            better = max(rate["retrieval"], rate["model"])
            tau = {c: tot["tokens"] / tot[c + " rounds"] - 1 for c in CHOICES}
            report[name][key] = {**{k: round(v, 2) for k, v in rate.items()},
                                 **{f"tau {k}": round(v, 2) for k, v in tau.items()},
                                 "both_vs_better_half": round(rate["both"] / better, 3),
                                 "oracle_vs_better_half": round(rate["oracle"] / better, 3)}  # fmt: skip
    return report


def arguments(per_category: int) -> argparse.ArgumentParser:
    """The options `talon_bound.py` and `talon_switch_features.py` share."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument(
        "--config", default="benchmarks/configs/talon-qwen2.5-coder-0.5b-instruct-best-ee-int8-n2.json"
    )
    ap.add_argument("--exit-heads", default="model_cards/exits-qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--exit-layer", type=int, default=22)
    ap.add_argument("--model-drafts", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompts", default="../shared/data/eval/spec_bench_dev.jsonl")
    ap.add_argument("--per-category", type=int, default=per_category)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--context", type=int, default=400)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    return ap


def outcomes_and_costs(args) -> tuple[dict, list[dict], dict]:
    """Talon's config, `drafter_outcomes` and `measured_costs` (with the mean lookup) for parsed `arguments`."""
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.target, dtype=getattr(torch, args.dtype))
    talon = read_config(args.config)
    retriever = Retriever(RetrievalConfig.from_dict(talon["retrieval"]), model, tok)
    exits = load_exit_lm(model, args.exit_heads, draft_vocab=True)
    rows, lookup_ms = drafter_outcomes(model, tok, retriever, exits, args.exit_layer, args.model_drafts, args)
    costs = measured_costs(model, args.exit_heads, rows[0]["seq"], args.exit_layer, args.context, args.reps)
    costs["lookup"] = statistics.mean(lookup_ms)
    return talon, rows, costs


def main() -> None:
    args = arguments(per_category=1).parse_args()
    talon, rows, costs = outcomes_and_costs(args)
    n_model = args.model_drafts
    rounds = RoundCosts(costs, n_model, talon)
    verify, lookup, draft = costs["verify"], costs["lookup"], n_model * costs["step"]
    print(f"ms: lookup {lookup:.2f}, model draft {draft:.1f}, verify 1/3/9/17/25 nodes "
          f"{verify[1]:.1f}/{verify[3]:.1f}/{verify[9]:.1f}/{verify[17]:.1f}/{verify[25]:.1f}")  # fmt: skip

    totals = choice_totals(rows, rounds)
    for row in rows:
        group, n_pos, model_acc, drafts, confidence, truth = (
            row[k] for k in ("group", "n_pos", "model_acc", "drafts", "confidence", "truth")
        )
        ret = [(x["accepted"], x["nodes"], x["match"]) for x in row["retrieval"]]

        def options(t, row=row):
            return rounds.options(row, t)

        for pair in (("retrieval", "model"), ("retrieval", "both")):
            ms = oracle(lambda t, pair=pair: [options(t)[name] for name in pair], n_pos)
            for key in (group, "all"):
                totals[key]["oracle " + "|".join(pair)] += ms
        # causal rules: retrieval alone from a match of `k` tokens on, else both (or the model alone)
        for k in range(0, 13):
            for other in ("both", "model"):

                def rule(t, k=k, other=other, ret=ret):
                    return [options(t)["retrieval" if ret[t][2] >= k else other]]

                ms, _ = replay(rule, n_pos, lambda o: o[0])
                for key in (group, "all"):
                    totals[key][f"match>={k}?retrieval:{other}"] += ms
        # causal rules with the model's confidence: retrieval alone from a match of `k` on; else the model drafts
        # until a draft's probability is below `theta` (that draft kept: `min_confidence`), fused with retrieval
        for k in (3, 5, 8, 100):
            for theta in (0.0, 0.3, 0.5, 0.7, 0.9):

                def confident(t, k=k, theta=theta, ret=ret, drafts=drafts, confidence=confidence, truth=truth,
                              n_pos=n_pos):  # fmt: skip
                    r, nodes, match = ret[t]
                    if match >= k:
                        return [options(t)["retrieval"]]
                    steps = 1
                    while steps < n_model and t + steps < n_pos - 1 and confidence[t + steps - 1] >= theta:
                        steps += 1
                    m = 0
                    while m < steps and t + m < n_pos - 1 and drafts[t + m] == truth[t + m][0]:
                        m += 1
                    nodes_both = min(nodes, rounds.both_nodes) + steps + 1
                    return [(max(r, m), lookup + steps * costs["step"] + rounds.verify(nodes_both))]

                ms, _ = replay(confident, n_pos, lambda o: o[0])
                for key in (group, "all"):
                    totals[key][f"match>={k}?retrieval:model(conf>={theta})+retrieval"] += ms
        # causal rules with memory: fuse the model's chain while it was fully accepted the last time it ran
        # (retrieval alone otherwise), retrying it after `retry` rounds without it
        for retry in (1, 2, 4, 8):
            memory = {"ok": True, "idle": 0}

            def sticky(t, retry=retry, memory=memory, ret=ret, model_acc=model_acc):
                opts = options(t)
                if memory["ok"] or memory["idle"] >= retry:
                    memory["ok"], memory["idle"] = model_acc[t] == n_model, 0
                    return [opts["both"]]
                memory["idle"] += 1
                return [opts["retrieval"]]

            ms, _ = replay(sticky, n_pos, lambda o: o[0])
            for key in (group, "all"):
                totals[key][f"match>=inf?retrieval:both-while-model-accepted(retry {retry})"] += ms
    rules = sorted((k for k in totals["all"] if k.startswith("match")), key=lambda k: totals["all"][k])
    for r in [*rules, "oracle retrieval|model", "oracle retrieval|both"]:
        print(r, round(totals["all"]["tokens"] / totals["all"][r] * 1000, 1))
    print(
        "best causal rules overall:",
        [(r, round(totals["all"]["tokens"] / totals["all"][r] * 1000, 1)) for r in rules[:4]],
    )
    best_rule = rules[0]
    report = {}
    print(
        f"| group | retrieval | model | always both | oracle switch | oracle / better half | {best_rule} / better half |"
    )
    print("|---|---|---|---|---|---|---|")
    for key, tot in sorted(totals.items(), key=lambda kv: kv[0] == "all"):
        rate = {
            k: tot["tokens"] / v * 1000 for k, v in tot.items() if k != "tokens" and not k.endswith(" rounds")
        }
        ratio = rate["oracle"] / max(rate["retrieval"], rate["model"])
        rule_ratio = rate[best_rule] / max(rate["retrieval"], rate["model"])
        report[key] = {**{k: round(v, 2) for k, v in rate.items()}, "oracle_vs_better_half": round(ratio, 3),
                       "best_rule_vs_better_half": round(rule_ratio, 3)}  # fmt: skip
        print(f"| {key} | {rate['retrieval']:.1f} | {rate['model']:.1f} | {rate['both']:.1f} | {rate['oracle']:.1f} | "
              f"{ratio:.3f} | {rule_ratio:.3f} |")  # fmt: skip
    what_ifs = what_if_rates(rows, costs, n_model, talon)
    for name, groups in what_ifs.items():
        print(
            f"\n{name}: | group | retrieval | model | always both | oracle | tau r / m / both | both / better half |"
        )
        for key, r in sorted(groups.items(), key=lambda kv: kv[0] == "all"):
            print(f"| {key} | {r['retrieval']:.1f} | {r['model']:.1f} | {r['both']:.1f} | {r['oracle']:.1f} | "
                  f"{r['tau retrieval']:.2f} / {r['tau model']:.2f} / {r['tau both']:.2f} | "
                  f"{r['both_vs_better_half']:.3f} |")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {"args": vars(args), "costs": costs, "tokens_per_s": report, "what_if": what_ifs}, f, indent=1
            )


if __name__ == "__main__":
    main()
