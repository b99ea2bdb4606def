"""Training data read from a feature store (`hf-spec data features`), shared by every head trainer: which sequences
to train on (`--sources`, `--limit-tokens`) and a fixed held-out set (`--heldout-sources`, `--heldout`).

Sequence ids are `<source>/<document id>` (`answers/...`, `python-docs/...`). A source pattern is a source name
or a shell pattern of names (`pypi-*`); `ALL` (or none) means every source.

The held-out set depends only on its sources and its size: the `count` prompts of those sources whose ids hash
lowest (a prompt's sampled answers go with it), so heads trained on other sources or other amounts of data are
evaluated on the very same sequences, and no selection trains on them. The hash order keeps the set as it is while
a store grows, once every sequence of the held-out sources is captured (a corpus captures the target's answers
first). Sequences are read on demand (`lazy_store.py`): the store need not fit in memory.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass
from fnmatch import fnmatchcase

from hf_spec.training.features import FeatureStore
from hf_spec.training.lazy_store import lazy_sequences
from hf_spec.training.responses import prompt_id_of

AUTO = "auto"  # --heldout-sources default: the target's answers when the store holds them
NONE = "none"  # --heldout-sources none: held out from the training selection (`trainer.split_heldout`)
ANSWERS = "answers"
# what the EAGLE/HASS and Lyanna trainers read of a store (EAGLE-3 adds `aux_features`)
HEAD_KEYS = ("input_ids", "features", "topk_ids", "topk_logp", "response_mask")


def source_of(seq_id: str) -> str:
    """`python-docs/library/os#3` -> `python-docs`."""
    return seq_id.split("/", 1)[0]


def source_patterns(sources: str | None) -> tuple[str, ...] | None:
    """`"answers, pypi-*"` -> `("answers", "pypi-*")`; None, empty or containing `ALL` -> None (every source)."""
    names = tuple(s.strip() for s in (sources or "").split(",") if s.strip())
    if not names or any(name.upper() == "ALL" for name in names):
        return None
    return names


def matches(seq_id: str, patterns: tuple[str, ...] | None) -> bool:
    return patterns is None or any(fnmatchcase(seq_id, f"{p}/*") for p in patterns)


def tokens_by_source(store: FeatureStore) -> dict[str, int]:
    """Tokens of each source's newest captures, largest first."""
    counts: Counter[str] = Counter()
    for cid, n in store.captured().items():
        counts[source_of(cid)] += n
    return dict(counts.most_common())


def _no_match(store: FeatureStore, sources: str | None, what: str) -> ValueError:
    held = ", ".join(tokens_by_source(store)) or "nothing"
    return ValueError(f"no sequences of sources {sources!r} {what} in {store.folder} (it holds: {held})")


def select(
    store: FeatureStore, sources: str | None, limit_tokens: int | None, exclude: frozenset[str] = frozenset()
) -> list[str]:
    """The ids of the store's sequences to train on, in store order: of `sources` (see `source_patterns`), not in
    `exclude` (the held-out set), the first `limit_tokens` tokens (the sequence that crosses it included)."""
    patterns = source_patterns(sources)
    lengths = store.captured()
    chosen, total = [], 0
    for cid in store.ordered_ids():
        if cid in exclude or not matches(cid, patterns):
            continue
        if limit_tokens is not None and total >= limit_tokens:
            break
        chosen.append(cid)
        total += lengths[cid]
    if not chosen:
        raise _no_match(store, sources, "outside the held-out set" if exclude else "")
    return chosen


def heldout_ids(store: FeatureStore, sources: str | None, count: int) -> list[str]:
    """The fixed held-out set, in store order: the `count` prompts of `sources` whose ids hash lowest, with all
    their sequences (see the module docstring)."""
    patterns = source_patterns(sources)
    candidates = [cid for cid in store.ordered_ids() if matches(cid, patterns)]
    prompts = list(dict.fromkeys(prompt_id_of(cid) for cid in candidates))
    if count and not candidates:
        raise _no_match(store, sources, "to hold out")
    if len(prompts) < count:
        raise ValueError(
            f"--heldout {count}: {store.folder} holds only {len(prompts)} prompts of --heldout-sources {sources!r}"
        )
    chosen = set(sorted(prompts, key=lambda p: hashlib.sha1(p.encode()).hexdigest())[:count])
    return [cid for cid in candidates if prompt_id_of(cid) in chosen]


def resolve_heldout_sources(store: FeatureStore, value: str | None) -> str | None:
    """`auto` (or None): `answers` when the store holds any, else None; `none`: None. None means the held-out set
    is taken from the training selection itself (`trainer.split_heldout`, as without a store)."""
    if value is None or value == AUTO:
        return ANSWERS if any(source_of(cid) == ANSWERS for cid in store.done) else None
    return None if value == NONE else value


@dataclass
class StoreSplit:
    """Which of a store's sequences a run trains on and evaluates on (ids in store order)."""

    train: list[str]
    heldout: list[str]
    heldout_sources: str | None  # None: held out from `train` by the trainer
    train_tokens: int  # store tokens of `train` (before `--max-len` cuts)
    available_tokens: int  # store tokens of the training sources outside the held-out set


def split_store(
    store: FeatureStore,
    sources: str | None,
    limit_tokens: int | None,
    heldout_sources: str | None,
    heldout: int,
) -> StoreSplit:
    """The training selection and the fixed held-out set (`heldout` prompts of `heldout_sources`, resolved by
    `resolve_heldout_sources`), disjoint."""
    held_from = resolve_heldout_sources(store, heldout_sources)
    held = heldout_ids(store, held_from, heldout) if held_from is not None and heldout else []
    exclude = frozenset(held)
    lengths = store.captured()
    patterns = source_patterns(sources)
    available = sum(n for cid, n in lengths.items() if cid not in exclude and matches(cid, patterns))
    train = select(store, sources, limit_tokens, exclude)
    return StoreSplit(train, held, held_from, sum(lengths[cid] for cid in train), available)


def check_store(store: FeatureStore, target, keys: tuple[str, ...], what: str) -> None:
    """Refuse a store `what` (e.g. "EAGLE training") cannot train on: empty, captured from another target, or
    without one of the tensors `keys`. The features' dtype alone is no reason: the fingerprint is compared with a
    tolerance that holds across float32, bfloat16 and float16 (the trainers borrow the target's LM head in
    float32 whatever the dtype the features were captured in)."""
    from safetensors import safe_open

    from hf_spec.models.fingerprint import check_fingerprint

    if not store.shards:
        raise ValueError(f"{store.folder} holds no features: capture them with `hf-spec data features`")
    try:
        check_fingerprint(store.fingerprint, target, "this feature store")
    except ValueError as err:
        fp = store.fingerprint
        captured = f"{fp.get('model_type')} with hidden size {fp.get('hidden_size')}, {store.dtype or 'dtype unknown'}"
        raise ValueError(
            f"{store.folder} holds features of another target ({captured}) than the one loaded: capture features "
            f"with this target or give its own --target ({err})"
        ) from None
    with safe_open(str(store.folder / store.shards[0]), framework="pt") as shard:
        missing = [k for k in keys if k not in shard.keys()]
    if missing:
        raise ValueError(
            f"{store.folder} has no {missing}, which {what} needs"
            + (": capture with --aux-layers eagle3" if "aux_features" in missing else "")
        )


def store_training_data(
    store: FeatureStore,
    target,
    keys: tuple[str, ...],
    what: str,
    *,
    sources: str | None = None,
    limit_tokens: int | None = None,
    heldout_sources: str | None = AUTO,
    heldout: int = 16,
) -> tuple[list, list | None, list[str], dict]:
    """`(train sequences, held-out sequences or None, groups, info)` of a store for a trainer (`train_head`'s
    `sequences`, `heldout` and `groups`), read lazily; `info` goes into the training report. None held-out: the
    trainer holds out from the training sequences (`--heldout-sources none`, or a store without answers)."""
    check_store(store, target, keys, what)
    split = split_store(store, sources, limit_tokens, heldout_sources, heldout)
    wanted = set(split.train) | set(split.heldout)
    loaded = dict(zip(store.ordered_ids(wanted), lazy_sequences(store, wanted, keys), strict=True))
    info = {
        "features": str(store.folder),
        "features_dtype": store.dtype,
        "sources": sources,
        "limit_tokens": limit_tokens,
        "selected_tokens": split.train_tokens,
        "available_tokens": split.available_tokens,
        "heldout_sources": split.heldout_sources,
        "heldout_ids": split.heldout,
    }
    held = [loaded[cid] for cid in split.heldout] if split.heldout_sources is not None else None
    groups = [prompt_id_of(cid) for cid in split.train]  # sampled answers go with their prompt
    return [loaded[cid] for cid in split.train], held, groups, info
