"""Target features for head training, captured by one prefill forward per conversation and stored in shards.

Per token position t of a conversation (prompt + response):
- `input_ids[t]`;
- `features[t]`: the target's last-layer state at t before the final norm, scaled to unit RMS (`unit_features`):
  the target's own final norm + LM head turn it into exactly the target's logits, so a head that predicts it can
  reuse them;
- `topk_ids[t]`, `topk_logp[t]`: the K most likely next tokens of the target at t and their log-probabilities;
- `response_mask[t]`: 1 where token t belongs to the target's answer (for fixed text: to the trained span);
- `aux_features[t]` (only in stores captured with `aux_layers`): the target's raw `hidden_states[i]` for each i
  in `aux_layers` (0: the embeddings, i: the input of decoder layer i), concatenated: `(len(aux_layers) * hidden,)`,
  what EAGLE-3 fuses (its low/mid/high layers).

A shard is one safetensors file of concatenated conversations (`offsets` marks where each starts); the manifest
lists the conversations done and their lengths, so an interrupted capture resumes where it stopped and a
conversation whose answer grew (`hf-spec data responses --continue-cut`) is captured again; its newer copy
supersedes the old one. A shard is written to a temporary name and renamed, then listed in the manifest: a
half-written shard is never read. Fixed text (`training/corpus_features.py`) goes through the same loop
(`capture_sequences`) as the target's answers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from hf_spec.heads.features import unit_features
from hf_spec.io.integrity import save_tensors
from hf_spec.models.fingerprint import target_fingerprint
from hf_spec.models.layers import decoder_parts
from hf_spec.training.responses import Conversation, default_data_dir

MANIFEST = "manifest.json"


@dataclass
class FeatureStore:
    folder: Path
    shards: list[str] = field(default_factory=list)
    # conversation ids in shard order; a re-captured conversation appears again, its newest copy counts
    done: list[str] = field(default_factory=list)
    num_tokens: int = 0
    topk: int = 16
    fingerprint: dict = field(default_factory=dict)
    lengths: list[int] = field(default_factory=list)  # tokens of each entry of `done`
    aux_layers: list[int] = field(default_factory=list)  # hidden_states indices kept as `aux_features`
    dtype: str = ""  # the target's dtype at capture ("" in stores from before it was recorded)

    @classmethod
    def open(cls, folder: str | os.PathLike) -> FeatureStore:
        folder = Path(folder)
        path = folder / MANIFEST
        if not path.exists():
            return cls(folder)
        try:
            data = json.loads(path.read_text())
            store = cls(
                folder, data["shards"], data["done"], data["num_tokens"], data["topk"], data["fingerprint"]
            )
        except (json.JSONDecodeError, KeyError) as err:
            raise ValueError(
                f"{path}: corrupt feature manifest ({err}); delete the folder to recapture"
            ) from None
        # manifests written before lengths were recorded: read them from the shards' offsets
        store.lengths = data.get("lengths") or store._lengths_from_shards()
        store.aux_layers, store.dtype = list(data.get("aux_layers", [])), data.get("dtype", "")
        return store

    def _lengths_from_shards(self) -> list[int]:
        lengths: list[int] = []
        for name in self.shards:
            with safe_open(self.folder / name, framework="pt") as shard:
                lengths += shard.get_tensor("offsets").diff().tolist()
        return lengths

    def captured(self) -> dict[str, int]:
        """Conversation id -> token count of its newest capture."""
        return dict(zip(self.done, self.lengths, strict=True))

    def save_manifest(self) -> None:
        data = {
            "shards": self.shards,
            "done": self.done,
            "num_tokens": self.num_tokens,
            "topk": self.topk,
            "fingerprint": self.fingerprint,
            "lengths": self.lengths,
            "aux_layers": self.aux_layers,
            "dtype": self.dtype,
        }
        tmp = self.folder / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(self.folder / MANIFEST)

    def ordered_ids(self, ids: set[str] | None = None) -> list[str]:
        """The conversations (of `ids`, if given) in the order `load_sequences` returns them: of first capture."""
        return [cid for cid in dict.fromkeys(self.done) if ids is None or cid in ids]

    def load_sequences(
        self, ids: set[str] | None = None, keys: tuple[str, ...] | None = None
    ) -> list[dict[str, torch.Tensor]]:
        """Every conversation (of `ids`, if given) as a dict of tensors (`input_ids`, `features`, `topk_ids`,
        `topk_logp`, `response_mask`), features kept in bfloat16: its newest capture, at the place of its first
        (so a re-captured conversation keeps its place, e.g. in the held-out split); order: `ordered_ids`.
        `keys`: read only these tensors (default: all but `aux_features`, which only EAGLE-3 reads)."""
        entries = []
        for name in self.shards:
            shard = _read_shard(self.folder / name, keys)
            offsets = shard.pop("offsets").tolist()
            for start, end in zip(offsets[:-1], offsets[1:], strict=True):
                entries.append({key: value[start:end] for key, value in shard.items()})
        newest = dict(zip(self.done, entries, strict=True))
        return [newest[cid] for cid in self.ordered_ids(ids)]


def capture_features(
    model,
    conversations: list[Conversation],
    data_dir: str | os.PathLike | None = None,
    *,
    target: str = "",
    topk: int | None = None,
    aux_layers: tuple[int, ...] = (),
    shard_tokens: int = 65536,
    logits_chunk: int = 256,
    progress: bool = True,
) -> FeatureStore:
    """Capture features of `conversations` not captured yet into `<data_dir>/features`, keeping the target's
    `topk` most likely next tokens per position (None: as many as the store already keeps, 16 for a new one);
    with `aux_layers` (EAGLE-3's `hidden_states` indices) also those layers' states, into
    `<data_dir>/features-aux-I-J-K` (a store keeps one set of layers)."""
    name = "features" + ("-aux-" + "-".join(map(str, aux_layers)) if aux_layers else "")
    folder = Path(data_dir or default_data_dir(target or model.name_or_path)) / name
    items = [(c.id, c.input_ids, [0] * len(c.prompt_ids) + [1] * len(c.response_ids)) for c in conversations]
    return capture_sequences(
        model,
        items,
        folder,
        topk=topk,
        aux_layers=tuple(aux_layers),
        shard_tokens=shard_tokens,
        logits_chunk=logits_chunk,
        progress=progress,
    )


def open_store(model, folder: Path, topk: int | None, aux_layers: tuple[int, ...] = ()) -> FeatureStore:
    """The store at `folder`, checked to belong to `model` (same fingerprint, top-K, aux layers and dtype)."""
    from hf_spec.models.fetch import dtype_name

    folder.mkdir(parents=True, exist_ok=True)
    store = FeatureStore.open(folder)
    dtype = dtype_name(model.dtype)
    if store.shards and store.dtype and store.dtype != dtype:  # before the fingerprint, which the dtype moves
        raise ValueError(
            f"{folder} was captured from the target in {store.dtype}, not {dtype}: use that dtype"
        )
    fingerprint = target_fingerprint(model)
    if store.shards and store.fingerprint.get("signature") != fingerprint["signature"]:
        raise ValueError(f"{folder} holds features of another target; use another --data-dir")
    if topk is None:
        topk = store.topk if store.shards else 16
    vocab = model.get_input_embeddings().weight.shape[0]
    if not 1 <= topk <= vocab:
        raise ValueError(f"topk must be in 1..{vocab} (the target's vocabulary), got {topk}")
    if store.shards and store.topk != topk:
        raise ValueError(
            f"{folder} was captured with --topk {store.topk}, not {topk}: use that or another --data-dir"
        )
    layers = model.config.num_hidden_layers
    if any(not 0 <= i < layers for i in aux_layers):
        raise ValueError(
            f"aux layers must be in 0..{layers - 1} (hidden_states indices), got {list(aux_layers)}"
        )
    if store.shards and store.aux_layers != list(aux_layers):
        raise ValueError(
            f"{folder} was captured with aux layers {store.aux_layers}, not {list(aux_layers)}: use those or "
            "another folder"
        )
    store.topk, store.fingerprint, store.aux_layers, store.dtype = topk, fingerprint, list(aux_layers), dtype
    return store


@torch.no_grad()
def batch_features(
    model, parts, batch: list[tuple[list[int], list[int]]], topk: int, aux_layers=(), logits_chunk: int = 256
) -> list[dict[str, torch.Tensor]]:
    """The tensors a shard stores for each `(ids, mask)` of `batch` (see the module docstring), from one
    teacher-forced forward over them right-padded: with causal attention a position sees only those before it, so
    the padding after a sequence changes none of its states."""
    lengths = [len(ids) for ids, _ in batch]
    x = torch.zeros(len(batch), max(lengths), dtype=torch.long)  # [B, T]; the padding's id is never read
    for row, (ids, _) in enumerate(batch):
        x[row, : len(ids)] = torch.tensor(ids)
    real = torch.arange(x.shape[1])[None] < torch.tensor(lengths)[:, None]  # [B, T] the sequences' positions
    out = model.model(input_ids=x.to(model.device), output_hidden_states=bool(aux_layers))
    on_device = real.to(model.device)
    hidden = out.last_hidden_state[on_device]  # [sum(lengths), H], post-norm, sequence after sequence
    ids_k, logp_k = [], []
    for start in range(0, hidden.shape[0], logits_chunk):
        logp = torch.log_softmax(parts.lm_head(hidden[start : start + logits_chunk]).float(), dim=-1)
        top = torch.topk(logp, topk, dim=-1)
        ids_k.append(top.indices.to("cpu", torch.int32))
        logp_k.append(top.values.to("cpu", torch.float16))
    per_position = {
        "input_ids": x[real].to(torch.int32),
        "features": unit_features(hidden, parts.norm).to("cpu", torch.bfloat16),
        "topk_ids": torch.cat(ids_k),
        "topk_logp": torch.cat(logp_k),
        "response_mask": torch.tensor([m for _, mask in batch for m in mask], dtype=torch.uint8),
    }
    if aux_layers:  # [sum(lengths), len(aux_layers) * H]
        aux = [out.hidden_states[i][on_device] for i in aux_layers]
        per_position["aux_features"] = torch.cat(aux, dim=-1).to("cpu", torch.bfloat16)
    split = {key: value.split(lengths) for key, value in per_position.items()}
    return [{key: pieces[row] for key, pieces in split.items()} for row in range(len(batch))]


@torch.no_grad()
def capture_sequences(
    model,
    items: Iterable[tuple[str, list[int], list[int]]],
    folder: str | os.PathLike,
    *,
    topk: int | None = None,
    aux_layers: tuple[int, ...] = (),
    shard_tokens: int = 65536,
    logits_chunk: int = 256,
    progress: bool = True,
    total: int | None = None,
    on_shard: Callable[[FeatureStore], None] | None = None,
    batch_size: int = 1,
) -> FeatureStore:
    """Capture `(id, input_ids, mask)` items not captured yet (or captured at another length) into the store at
    `folder`, `batch_size` of them a forward, a shard every `shard_tokens` tokens; `on_shard(store)` after each
    shard is written."""
    store = open_store(model, Path(folder), topk, tuple(aux_layers))
    parts = decoder_parts(model)
    captured = store.captured()
    pending: list[tuple[str, dict[str, torch.Tensor]]] = []
    bar = tqdm(total=total, desc="target features", unit="seq", disable=not progress)
    for group in _groups(items, captured, batch_size):
        found = batch_features(model, parts, [(ids, mask) for _, ids, mask in group], store.topk, aux_layers,
                               logits_chunk)  # fmt: skip
        pending += [(seq_id, tensors) for (seq_id, _, _), tensors in zip(group, found, strict=True)]
        bar.update(len(group))
        if sum(len(p[1]["input_ids"]) for p in pending) >= shard_tokens:
            _write_shard(store, pending)
            pending = []
            if on_shard is not None:
                on_shard(store)
    if pending:
        _write_shard(store, pending)
        if on_shard is not None:
            on_shard(store)
    bar.close()
    return store


def _groups(items, captured: dict[str, int], size: int):
    """The items not captured yet (or captured at another length), `size` at a time, each checked."""
    group = []
    for seq_id, ids, mask in items:
        if captured.get(seq_id) == len(ids):
            continue
        if len(mask) != len(ids):
            raise ValueError(f"{seq_id}: mask of {len(mask)} tokens for {len(ids)} input ids")
        group.append((seq_id, ids, mask))
        if len(group) == size:
            yield group
            group = []
    if group:
        yield group


def _read_shard(path: Path, keys: tuple[str, ...] | None) -> dict[str, torch.Tensor]:
    with safe_open(path, framework="pt") as shard:
        names = [k for k in shard.keys() if (k in keys if keys is not None else k != "aux_features")]
        return {k: shard.get_tensor(k) for k in set(names) | {"offsets"}}


def _write_shard(store: FeatureStore, pending: list[tuple[str, dict[str, torch.Tensor]]]) -> None:
    name = f"shard-{len(store.shards):05d}.safetensors"
    lengths = [len(p[1]["input_ids"]) for p in pending]
    tensors = {key: torch.cat([p[1][key] for p in pending]).contiguous() for key in pending[0][1]}
    tensors["offsets"] = torch.tensor([0] + lengths).cumsum(0)
    tmp = store.folder / (name + ".tmp")
    save_tensors(tensors, str(tmp))
    tmp.replace(store.folder / name)
    store.shards.append(name)
    store.done.extend(p[0] for p in pending)
    store.lengths.extend(lengths)
    store.num_tokens += sum(lengths)
    store.save_manifest()
