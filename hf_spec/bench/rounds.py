"""Recording what every round of a method did, and replaying it at another machine's costs.

`hf-spec bench --record-rounds FILE` runs each hf-spec method under a `RoundRecorder` and writes, per method, one
entry a round (`ROUNDS_FORMAT`):

    p: the tree's parents (an int: a chain of that many nodes)      a: the accepted nodes      n: tokens committed
    t / d: draft work, `[[rows, calls], ...]` per decoder-layer forward of the target's layers (early exit, HiSpec)
           and of the drafter's own modules (heads, draft models), rows = tokens through one layer call
    v: the target's decoder-layer forwards while verifying, same form (HiSpec verifies only its later layers)
    lm: rows through LM heads while drafting      s: the draft's seconds on the recording machine

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

ROUNDS_FORMAT = "hf-spec rounds 1"


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
        t0 = time.perf_counter()
        try:
            return fn()
        finally:
            if self._round is not None:
                self._round["s"] += time.perf_counter() - t0
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
        config = self.model.config
        return {
            "format": ROUNDS_FORMAT,
            "target": getattr(config, "_name_or_path", "") or type(self.model).__name__,
            "num_layers": config.num_hidden_layers,
            "hidden_size": config.hidden_size,
            "vocab_size": config.vocab_size,
            "methods": self.methods,
        }

    def write(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_dict(), separators=(",", ":")))


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


def read_rounds(path: str | Path) -> dict:
    """A recording written by `RoundRecorder.write` (`ValueError` for another file)."""
    data = json.loads(Path(path).read_text())
    if data.get("format") != ROUNDS_FORMAT:
        raise ValueError(f"{path} is not an `hf-spec bench --record-rounds` file ({ROUNDS_FORMAT!r})")
    return data


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


def replay_speedup(
    rounds: list[dict],
    layer_cost: dict[int, float],
    lm_cost: dict[int, float],
    num_layers: int,
    overhead: float,
    token_seconds: float,
) -> dict:
    """Price recorded rounds: each decoder-layer call by `layer_cost` (`{rows: seconds}` of one layer of the
    target's shape; a head's layer is priced as one), LM-head rows by `lm_cost`, the verification's LM head over
    `nodes + 1` rows, `overhead` seconds of loop a round; a draft without model calls costs its recorded seconds.
    Returns `{"speedup": plain-decoding seconds a token / replayed seconds a token, "tau", "rounds", ...}`."""
    seconds = tokens = 0.0
    for r in rounds:
        nodes = r["p"] if isinstance(r["p"], int) else len(r["p"])
        verify = (
            sum(c * interpolate(layer_cost, q) for q, c in r["v"])
            if r["v"]
            else num_layers * interpolate(layer_cost, nodes + 1)
        )
        draft = sum(c * interpolate(layer_cost, q) for part in ("t", "d") for q, c in r[part])
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
