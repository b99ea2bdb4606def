"""Recording what every round of a method did, and replaying it at another machine's costs.

`hf-spec bench --record-rounds FILE` runs each hf-spec method under a `RoundRecorder`. In memory (and as
`read_rounds` returns it) a method has one entry a round:

    p: the tree's parents (an int: a chain of that many nodes)      a: the accepted nodes      n: tokens committed
    t / d: draft work, `[[rows, calls], ...]` per decoder-layer forward of the target's layers (early exit, HiSpec)
           and of the drafter's own modules (heads, draft models), rows = tokens through one layer call
    v: the target's decoder-layer forwards while verifying, same form (HiSpec verifies only its later layers)
    lm: rows through LM heads while drafting
    s: the draft's CPU seconds on the recording machine (its thread's: other work on a shared machine does not
       count; a drafter with torch's intra-op threads is undercounted, but its `s` is not priced)

The file (`ROUNDS_FORMAT`) stores each method's rounds by column, with every distinct tree and every distinct
draft work listed once: `trees` (parent lists, or an int for a chain), `work` (`[t, d, v, lm]`, `v` left empty
where it is one forward of every target layer over `[root] + tree`), and `rounds` = `{"tree": [...], "last": [...],
"n": [...], "work": [...], "us": [...]}`: indices into those lists, the last accepted node (-1: none; the path is
its ancestors), the committed tokens and the draft's CPU microseconds. A few thousand rounds take tens of kilobytes.

`replay_speedup` prices each round with costs measured elsewhere (a GPU: `benchmarks/gpu_check.py`): a decoder
layer of `rows` tokens, an LM head of `rows` rows, the loop's overhead a round and plain decoding's seconds a
token. A drafter that runs no model (prompt lookup, retrieval) keeps its recorded host seconds.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
from torch import nn

ROUNDS_FORMAT = "hf-spec rounds 2"
_EXPANDED_FORMAT = "hf-spec rounds 1"  # one dict a round: what `read_rounds` returns, also read


def _layers(module: nn.Module) -> list[nn.Module]:
    return [m for m in module.modules() if type(m).__name__.endswith("DecoderLayer")]


def _modules_of(obj, seen: set[int], depth: int = 4) -> Iterator[nn.Module]:
    """The `nn.Module`s an hf-spec drafter holds (heads, draft models, nested drafters' parts)."""
    if id(obj) in seen or depth < 0:
        return
    seen.add(id(obj))
    if isinstance(obj, nn.Module):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _modules_of(item, seen, depth - 1)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _modules_of(item, seen, depth - 1)
    elif type(obj).__module__.startswith("hf_spec") and hasattr(obj, "__dict__"):
        for item in vars(obj).values():
            yield from _modules_of(item, seen, depth - 1)


def _rows(args: tuple, kwargs: dict) -> int:
    hidden = args[0] if args else kwargs.get("hidden_states")
    return int(hidden.numel() // hidden.shape[-1]) if hidden is not None else 0


class RoundRecorder:
    """Records every round of the methods run inside `method(name, decoder)` blocks on `model`."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.methods: dict[str, dict] = {}
        self._round: dict | None = None  # the work since the last commit, while a round runs
        self._phase = "v"  # "draft" while the drafter proposes or observes, else "v" (verifying)
        self._stepping = False  # inside `RoundEngine.step`

    @contextlib.contextmanager
    def method(self, name: str, decoder) -> Iterator[None]:
        """Record the rounds of `decoder` (a `SpeculativeDecoder`) on the model until the block ends."""
        from hf_spec.engine.round import RoundEngine
        from hf_spec.methods.head_drafter import HeadDrafter

        drafter = decoder.drafter_for(self.model)
        entry = self.methods.setdefault(name, _method_entry(decoder.config))
        target_layers = set(map(id, _layers(self.model)))
        own = [m for m in _modules_of(drafter, {id(self.model)}) if m is not self.model]
        layers = [(layer, "t") for layer in _layers(self.model)]
        layers += [(layer, "d") for m in own for layer in _layers(m) if id(layer) not in target_layers]
        lm_head = self.model.get_output_embeddings()
        handles = [
            layer.register_forward_pre_hook(self._layer_hook(who), with_kwargs=True) for layer, who in layers
        ]
        handles.append(lm_head.register_forward_pre_hook(self._lm_hook(), with_kwargs=True))
        saved = {name: getattr(RoundEngine, name) for name in ("step", "propose", "commit", "observe")}
        saved_lm = HeadDrafter.lm_logits
        recorder = self
        self._round = _empty_round()  # observe's work after a commit counts toward the next round

        def step(engine, *args, **kwargs):
            recorder._stepping = True  # the prefill before the first round is no round's work
            try:
                return saved["step"](engine, *args, **kwargs)
            finally:
                recorder._stepping = False

        def propose(row):
            return recorder._drafting(lambda: saved["propose"](row))

        def commit(engine, row, tree, logits):
            committed = saved["commit"](engine, row, tree, logits)
            recorder._finish(entry, tree, committed)
            return committed

        def observe(engine, *args):
            return recorder._drafting(lambda: saved["observe"](engine, *args))

        def lm_logits(head_drafter, normed):
            if recorder._stepping:
                recorder._round["lm"] += int(normed.numel() // normed.shape[-1])
            return saved_lm(head_drafter, normed)

        try:
            RoundEngine.step, RoundEngine.commit, RoundEngine.observe = step, commit, observe
            RoundEngine.propose = staticmethod(propose)
            HeadDrafter.lm_logits = lm_logits
            yield
        finally:
            RoundEngine.step, RoundEngine.commit, RoundEngine.observe = (
                saved["step"],
                saved["commit"],
                saved["observe"],
            )
            RoundEngine.propose = staticmethod(saved["propose"])
            HeadDrafter.lm_logits = saved_lm
            for handle in handles:
                handle.remove()
            self._round = None

    def _drafting(self, fn: Callable):
        phase, self._phase = self._phase, "draft"
        t0 = time.thread_time()  # CPU time, not wall time: recordings are made on shared, loaded machines
        try:
            return fn()
        finally:
            if self._round is not None:
                self._round["s"] += time.thread_time() - t0
            self._phase = phase

    def _layer_hook(self, who: str):
        def hook(module, args, kwargs):
            if self._stepping:
                self._round[who if self._phase == "draft" else "v"][_rows(args, kwargs)] += 1

        return hook

    def _lm_hook(self):
        def hook(module, args, kwargs):
            if self._stepping and self._phase == "draft":
                self._round["lm"] += _rows(args, kwargs)

        return hook

    def _finish(self, entry: dict, tree, committed) -> None:
        """The round's record, once its tree is verified and committed."""
        r = self._round
        parents = tree.parents.tolist()
        entry["rounds"].append(
            {
                "p": len(parents) if tree.is_chain else parents,
                "a": list(committed.accepted),
                "n": len(committed.new_tokens),
                "t": sorted(r["t"].items()),
                "d": sorted(r["d"].items()),
                "v": sorted(r["v"].items()),
                "lm": r["lm"],
                "s": round(r["s"], 6),
            }
        )
        self._round = _empty_round()

    def to_dict(self) -> dict:
        """The recording as `read_rounds` returns it (one dict a round)."""
        from hf_spec.bench.machine import machine_info

        config = self.model.config
        info = machine_info()
        target = getattr(config, "_name_or_path", "") or type(self.model).__name__
        return {
            "format": _EXPANDED_FORMAT,
            "target": Path(target).name if Path(target).is_absolute() else target,  # a local folder: its name
            "num_layers": config.num_hidden_layers,
            "hidden_size": config.hidden_size,
            "vocab_size": config.vocab_size,
            "machine": {k: info[k] for k in ("cpu", "cores", "torch", "transformers", "date")},
            "methods": self.methods,
        }

    def write(self, path: str | Path) -> None:
        write_rounds(path, self.to_dict())


def _empty_round() -> dict:
    return {"v": Counter(), "t": Counter(), "d": Counter(), "lm": 0, "s": 0.0}


def _method_entry(config) -> dict:
    """`family` (the method's name) and, for a hybrid, the families of its halves (Talon: retrieval + its model)."""
    entry: dict = {"family": config.method, "rounds": []}
    if config.method == "talon":
        drafter = getattr(config, "drafter", None)
        inner = drafter.method if hasattr(drafter, "method") else str(drafter or "early-exit").split(":")[0]
        entry["halves"] = ["retrieval", inner]
    return entry


def write_rounds(path: str | Path, data: dict) -> None:
    """Write a recording (as `read_rounds` returns it) to `path` in the columnar `ROUNDS_FORMAT`."""
    num_layers = data["num_layers"]
    methods = {}
    for name, entry in data["methods"].items():
        trees: dict[str, int] = {}
        works: dict[str, int] = {}
        cols: dict[str, list] = {"tree": [], "last": [], "n": [], "work": [], "us": []}
        for r in entry["rounds"]:
            parents = list(range(-1, r["p"] - 1)) if isinstance(r["p"], int) else r["p"]
            last = r["a"][-1] if r["a"] else -1
            if r["a"] != _path_to(parents, last):
                raise ValueError(f"{name}: accepted nodes {r['a']} are not a path from the root of {r['p']}")
            full = [[len(parents) + 1, num_layers]]
            t, d, v = ([list(pair) for pair in r[k]] for k in ("t", "d", "v"))  # (rows, calls) pairs as lists
            work = [t, d, [] if v == full else v, r["lm"]]
            cols["tree"].append(trees.setdefault(json.dumps(r["p"]), len(trees)))
            cols["work"].append(works.setdefault(json.dumps(work), len(works)))
            cols["last"].append(last)
            cols["n"].append(r["n"])
            cols["us"].append(round(r["s"] * 1e6))
        rest = {k: v for k, v in entry.items() if k != "rounds"}
        methods[name] = {**rest, "trees": [json.loads(t) for t in trees],
                         "work": [json.loads(w) for w in works], "rounds": cols}  # fmt: skip
    out = {**data, "format": ROUNDS_FORMAT, "methods": methods}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    # one line a method's part: small, and a changed recording shows in a diff
    text = json.dumps({k: v for k, v in out.items() if k != "methods"}, separators=(",", ":"))[:-1]
    parts = [f"{json.dumps(n)}:{json.dumps(m, separators=(',', ':'))}" for n, m in methods.items()]
    Path(path).write_text(text + ',"methods":{\n' + ",\n".join(parts) + "\n}}\n")


def read_rounds(path: str | Path) -> dict:
    """A recording written by `write_rounds` (`RoundRecorder.write`), one dict a round (`ValueError` for another
    file)."""
    data = json.loads(Path(path).read_text())
    if data.get("format") == _EXPANDED_FORMAT:
        return data
    if data.get("format") != ROUNDS_FORMAT:
        raise ValueError(f"{path} is not an `hf-spec bench --record-rounds` file ({ROUNDS_FORMAT!r})")
    methods = {}
    for name, entry in data["methods"].items():
        cols, rounds = entry["rounds"], []
        for tree, last, n, work, us in zip(
            *(cols[k] for k in ("tree", "last", "n", "work", "us")), strict=True
        ):
            p = entry["trees"][tree]
            parents = list(range(-1, p - 1)) if isinstance(p, int) else p
            t, d, v, lm = entry["work"][work]
            v = v or [[len(parents) + 1, data["num_layers"]]]
            rounds.append({"p": p, "a": _path_to(parents, last), "n": n, "t": t, "d": d, "v": v, "lm": lm,
                           "s": us / 1e6})  # fmt: skip
        rest = {k: v for k, v in entry.items() if k not in ("trees", "work", "rounds")}
        methods[name] = {**rest, "rounds": rounds}
    return {**data, "format": _EXPANDED_FORMAT, "methods": methods}


def _path_to(parents: list[int], last: int) -> list[int]:
    """The nodes from the root's child down to `last` (-1: none)."""
    path = []
    while last >= 0:
        path.append(last)
        last = parents[last]
    return path[::-1]


def interpolate(costs: dict[int, float], rows: int) -> float:
    """Seconds at `rows` from measured `{rows: seconds}`: linear between measured sizes, the last slope beyond."""
    sizes = sorted(costs)
    if rows in costs:
        return costs[rows]
    if len(sizes) == 1:
        return costs[sizes[0]] * max(rows, 1) / max(sizes[0], 1)
    if rows > sizes[-1]:
        a, b = sizes[-2], sizes[-1]
        return costs[b] + (costs[b] - costs[a]) / (b - a) * (rows - b)
    return float(np.interp(rows, sizes, [costs[s] for s in sizes]))


def monotone(costs: dict[int, float]) -> dict[int, float]:
    """`{rows: seconds}` made non-decreasing in `rows` (pooling adjacent violators: each run of sizes that got
    cheaper takes the run's mean), so noise in a measurement never makes more rows cost less, nor an extrapolation
    negative."""
    blocks: list[list[float]] = []  # [mean, count] of pooled runs, in order of size
    for size in sorted(costs):
        blocks.append([max(costs[size], 0.0), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, c1), (m2, c2) = blocks.pop(-2), blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    values = [m for m, c in blocks for _ in range(int(c))]
    return dict(zip(sorted(costs), values, strict=True))


def replay_speedup(
    rounds: list[dict],
    layer_cost: dict[int, float],
    lm_cost: dict[int, float],
    num_layers: int,
    overhead: float,
    token_seconds: float,
    recorded_layers: int | None = None,
) -> dict:
    """Price recorded rounds: each decoder-layer call by `layer_cost` (`{rows: seconds}` of one layer of the
    target's shape, made `monotone`; a head's layer is priced as one), LM-head rows by `lm_cost` (the same), the verification's LM head over
    `nodes + 1` rows, `overhead` seconds of loop a round; a draft without model calls costs its recorded seconds.
    Calls of the recorded target's layers (`t`, `v`) count `num_layers / recorded_layers` times each: an exit
    after 22 of 24 layers drafts through 22/24 of the replayed target's `num_layers`.
    Returns `{"speedup": plain-decoding seconds a token / replayed seconds a token, "tau", "rounds", ...}`."""
    scale = num_layers / recorded_layers if recorded_layers else 1.0
    layer_cost, lm_cost = monotone(layer_cost), monotone(lm_cost)
    seconds = tokens = 0.0
    for r in rounds:
        nodes = r["p"] if isinstance(r["p"], int) else len(r["p"])
        verify = (
            scale * sum(c * interpolate(layer_cost, q) for q, c in r["v"])
            if r["v"]
            else num_layers * interpolate(layer_cost, nodes + 1)
        )
        draft = scale * sum(c * interpolate(layer_cost, q) for q, c in r["t"])
        draft += sum(c * interpolate(layer_cost, q) for q, c in r["d"])
        if r["lm"]:
            draft += interpolate(lm_cost, r["lm"])
        if not (r["t"] or r["d"] or r["lm"]):  # a host-only drafter: its own seconds
            draft = r["s"]
        seconds += verify + interpolate(lm_cost, nodes + 1) + draft + overhead
        tokens += r["n"]
    if not rounds or not seconds:
        return {"speedup": None, "tau": None, "rounds": len(rounds)}
    return {
        "speedup": token_seconds * tokens / seconds,
        "tau": tokens / len(rounds),
        "rounds": len(rounds),
        "ms_per_round": 1e3 * seconds / len(rounds),
    }


def paper_ratios(speedups: dict[str, float | None], families: dict[str, dict]) -> dict[str, float | None]:
    """The three claims measured on GPUs in the seed papers, from replayed speedups by method name:
    Lyanna / the best HASS head (`eagle`), HiSpec / the best single exit (`early-exit`), Talon / its better half."""

    def best(family: str) -> float | None:
        found = [s for name, s in speedups.items() if s and families[name]["family"] == family]
        return max(found) if found else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    talon = [name for name, e in families.items() if e["family"] == "talon" and speedups.get(name)]
    halves = [best(f) for name in talon for f in families[name].get("halves", [])]
    better_half = max((h for h in halves if h), default=None)
    return {
        "lyanna_vs_hass": ratio(best("lyanna"), best("eagle")),
        "hispec_vs_best_exit": ratio(best("hispec"), best("early-exit")),
        "talon_vs_better_half": ratio(best("talon"), better_half),
    }
