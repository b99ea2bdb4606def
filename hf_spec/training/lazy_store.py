"""A feature store read on demand: sequences whose tensors are sliced out of the memory-mapped shards when a batch
asks for them, so a store larger than memory (a corpus with EAGLE-3's aux layers: gigabytes) trains as it is."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from hf_spec.training.features import FeatureStore


class _Shard:
    """One open (memory-mapped) shard file."""

    def __init__(self, path: Path) -> None:
        self.handle = safe_open(str(path), framework="pt")
        self.keys = [k for k in self.handle.keys() if k != "offsets"]
        self.offsets = self.handle.get_tensor("offsets").tolist()

    def read(self, key: str, start: int, end: int) -> torch.Tensor:
        return self.handle.get_slice(key)[start:end]


class LazySequence(Mapping):
    """One sequence of a store: `seq[key]` reads that tensor's rows `(seq_len, ...)` from its shard."""

    def __init__(self, shard: _Shard, start: int, end: int, keys: tuple[str, ...]) -> None:
        self.shard, self.start, self.end, self.keys_ = shard, start, end, keys

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self.keys_:
            raise KeyError(key)
        return self.shard.read(key, self.start, self.end)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys_)

    def __len__(self) -> int:
        return len(self.keys_)


def lazy_sequences(
    store: FeatureStore, ids: set[str] | None = None, keys: tuple[str, ...] | None = None
) -> list[LazySequence]:
    """The sequences `FeatureStore.load_sequences(ids, keys)` returns, in its order, each read on access."""
    entries = []
    for name in store.shards:
        shard = _Shard(store.folder / name)
        wanted = tuple(k for k in shard.keys if (k in keys if keys is not None else k != "aux_features"))
        missing = set(keys or ()) - set(shard.keys)
        if missing:
            raise ValueError(f"{store.folder / name} has no {sorted(missing)} (captured without them)")
        for start, end in zip(shard.offsets[:-1], shard.offsets[1:], strict=True):
            entries.append(LazySequence(shard, start, end, wanted))
    newest = dict(zip(store.done, entries, strict=True))
    return [newest[cid] for cid in store.ordered_ids(ids)]
