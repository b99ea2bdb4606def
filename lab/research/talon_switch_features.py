"""Can any causal signal tell Talon's switch which drafter to run? Per-round policies over features known before a
round's verification, searched on the very rounds they are scored on (in-sample: an upper bound for that feature
set) and on the other half of the prompts (2-fold: first vs second prompt of each category).

Data and costs as `talon_bound.py` (greedy continuations, the retriever of Talon's config, the int8 layer-22 exit
chain of `--model-drafts` drafts, measured lookup / draft step / verification costs). A policy maps a feature key
to an action; the search is coordinate ascent over keys, scored by replaying every continuation.

Feature sets (match length bucketed 0, 1, 2, 3, 4-7, 8+):
- `match`; `match+shape` (+ distinct first tokens of the retrieval tree, depth of its top path);
  `match+last` / `match+shape+last` (+ last round's outcome: retrieval got >= 2 / the model got its whole chain /
  neither) - free signals; actions retrieval, model, both;
- `match+conf`, `match+conf+agree`, `match+conf+agree+last`: + the exit's confidence in its first draft (and whether
  that draft is the retrieval tree's first token), which costs the first draft step in every round; actions
  retrieval (that step wasted), both with 1 draft, both with the whole chain.

Usage: python lab/research/talon_switch_features.py [--per-category 2] [--out FILE]
"""

from __future__ import annotations

import json
from collections import defaultdict

from talon_bound import RoundCosts, arguments, oracle, outcomes_and_costs

FREE = ("match", "match+shape", "match+last", "match+shape+last")
PAID = ("match+conf", "match+conf+agree", "match+conf+agree+last")


def match_bucket(match: int) -> int:
    return match if match < 4 else (4 if match < 8 else 8)


def confidence_bucket(p: float) -> int:
    return sum(p >= edge for edge in (0.3, 0.6, 0.8, 0.95))


def feature_key(name: str, row: dict, t: int, last: int) -> tuple:
    ret = row["retrieval"][t]
    key = (match_bucket(ret["match"]),)
    if "shape" in name:
        key += (min(ret["n_first"], 3), min(ret["depth"], 10) // 3)
    if "conf" in name:
        key += (confidence_bucket(row["confidence"][t]),)
    if "agree" in name:
        key += (int(row["drafts"][t] == ret["first"]),)
    if "last" in name:
        key += (last,)
    return key


class Rounds(RoundCosts):
    """`RoundCosts` with the choices of rounds that paid the first draft step for its confidence, and policy
    replay and search over them."""

    def options(self, row: dict, t: int) -> dict[str, tuple[int, float]]:
        opts = super().options(row, t)
        ret = row["retrieval"][t]
        r, m, step = ret["accepted"], row["model_acc"][t], self.costs["step"]
        retrieval_ms = opts["retrieval"][1]
        one_draft_ms = self.costs["lookup"] + step + self.verify(min(ret["nodes"], self.both_nodes) + 2)
        return opts | {
            "step+retrieval": (r, retrieval_ms + step),
            "step+both1": (max(r, min(m, 1)), one_draft_ms),
            "step+both": opts["both"],
        }

    def replay(self, rows: list[dict], policy) -> tuple[float, dict]:
        """(tokens/s overall, tokens/s per group) of choosing `policy(row, t, last) -> action` every round."""
        ms, tokens = defaultdict(float), defaultdict(int)
        for row in rows:
            t, last = 0, 0
            while t < row["n_pos"] - 1:
                action = policy(row, t, last)
                acc, cost = self.options(row, t)[action]
                # last round's outcome: retrieval got >= 2 accepted / the model (if it ran) its whole chain / neither
                ran_model = action not in ("retrieval", "step+retrieval")
                model_all = ran_model and row["model_acc"][t] == self.n_model
                last = 0 if row["retrieval"][t]["accepted"] >= 2 else (1 if model_all else 2)
                t += acc + 1
                for key in (row["group"], "all"):
                    ms[key] += cost
            for key in (row["group"], "all"):
                tokens[key] += row["n_pos"] - 1
        rate = {key: 1000 * tokens[key] / ms[key] for key in ms}
        return rate["all"], rate

    def fixed(self, rows: list[dict], action: str) -> tuple[float, dict]:
        return self.replay(rows, lambda row, t, last: action)

    def oracle(self, rows: list[dict]) -> float:
        ms = sum(
            oracle(
                lambda t, row=row: [self.options(row, t)[a] for a in ("retrieval", "model", "both")],
                row["n_pos"],
            )
            for row in rows
        )
        return 1000 * sum(row["n_pos"] - 1 for row in rows) / ms

    def search(self, rows: list[dict], name: str, passes: int = 3) -> dict:
        """Coordinate ascent over the feature keys of `rows`: each key's action maximising overall tokens/s."""
        actions = (
            ("step+retrieval", "step+both1", "step+both") if name in PAID else ("retrieval", "model", "both")
        )
        keys = sorted(
            {
                feature_key(name, row, t, last)
                for row in rows
                for t in range(row["n_pos"])
                for last in range(3)
            }
        )
        policy = dict.fromkeys(keys, actions[-1])
        score = self.replay(rows, self.policy(name, policy, actions[-1]))[0]
        for _ in range(passes):
            changed = False
            for key in keys:
                for action in actions:
                    old = policy[key]
                    if action == old:
                        continue
                    policy[key] = action
                    new = self.replay(rows, self.policy(name, policy, actions[-1]))[0]
                    if new > score + 1e-9:
                        score, changed = new, True
                    else:
                        policy[key] = old
            if not changed:
                break
        return policy

    @staticmethod
    def policy(name: str, table: dict, default: str):
        return lambda row, t, last: table.get(feature_key(name, row, t, last), default)


def main() -> None:
    args = arguments(per_category=2).parse_args()
    talon, rows, costs = outcomes_and_costs(args)
    rounds = Rounds(costs, args.model_drafts, talon)
    print(f"ms: lookup {costs['lookup']:.2f}, draft step {costs['step']:.1f}, verify 1/9 nodes "
          f"{costs['verify'][1]:.1f}/{costs['verify'][9]:.1f}")  # fmt: skip

    seen, halves = defaultdict(int), ([], [])
    for row in rows:
        halves[seen[row["group"]] % 2].append(row)
        seen[row["group"]] += 1
    report = {"args": vars(args), "costs": costs, "sets": {}, "policies": {}}
    for label, subset in (("all", rows), ("first", halves[0]), ("second", halves[1])):
        if not subset:
            continue
        r, m, b = (rounds.fixed(subset, a)[0] for a in ("retrieval", "model", "both"))
        best = rounds.oracle(subset)
        report["sets"][label] = {"retrieval": r, "model": m, "both": b, "oracle": best,
                                 "oracle_vs_better_half": best / max(r, m)}  # fmt: skip
        print(f"{label}: tok/s retrieval {r:.1f} model {m:.1f} both {b:.1f} oracle {best:.1f} "
              f"(oracle / better half {best / max(r, m):.3f})")  # fmt: skip
    print(
        "| features | in-sample / better half | trained on first, tested on second | trained on second, on first |"
    )
    print("|---|---|---|---|")
    for name in (*FREE, *PAID):
        row_out = {}
        subsets = [("in-sample", rows, rows)]
        if halves[1]:
            subsets += [("first->second", halves[0], halves[1]), ("second->first", halves[1], halves[0])]
        for label, train, test in subsets:
            table = rounds.search(train, name)
            default = "step+both" if name in PAID else "both"
            rate, groups = rounds.replay(test, rounds.policy(name, table, default))
            better = max(rounds.fixed(test, "retrieval")[0], rounds.fixed(test, "model")[0])
            row_out[label] = {"tokens_per_s": rate, "vs_better_half": rate / better,
                              "groups": groups, "actions": dict(sorted(
                                  (str(k), v) for k, v in table.items()))}  # fmt: skip
        report["policies"][name] = row_out
        cells = [f"{row_out[k]['vs_better_half']:.3f}" for k in ("in-sample", "first->second", "second->first")
                 if k in row_out]  # fmt: skip
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
