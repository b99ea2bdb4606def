"""Target features for head training, captured by one prefill forward per conversation and stored in shards.

Per token position t of a conversation (prompt + response):
- `input_ids[t]`;
- `features[t]`: the target's last-layer state at t before the final norm, scaled to unit RMS (`unit_features`):
  the target's own final norm + LM head turn it into exactly the target's logits, so a head that predicts it can
  reuse them;
- `topk_ids[t]`, `topk_logp[t]`: the K most likely next tokens of the target at t and their log-probabilities;
- `response_mask[t]`: 1 where token t belongs to the target's answer.

A shard is one safetensors file of concatenated conversations (`offsets` marks where each starts); the manifest
lists the conversations done and their lengths, so an interrupted capture resumes where it stopped and a
conversation whose answer grew (`hf-spec data responses --continue-cut`) is captured again; its newer copy
supersedes the old one.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from hf_spec.heads.features import unit_features
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
        }
        tmp = self.folder / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(self.folder / MANIFEST)

    def ordered_ids(self, ids: set[str] | None = None) -> list[str]:
        """The conversations (of `ids`, if given) in the order `load_sequences` returns them: of first capture."""
        return [cid for cid in dict.fromkeys(self.done) if ids is None or cid in ids]

    def load_sequences(self, ids: set[str] | None = None) -> list[dict[str, torch.Tensor]]:
        """Every conversation (of `ids`, if given) as a dict of tensors (`input_ids`, `features`, `topk_ids`,
        `topk_logp`, `response_mask`), features kept in bfloat16: its newest capture, at the place of its first
        (so a re-captured conversation keeps its place, e.g. in the held-out split); order: `ordered_ids`."""
        entries = []
        for name in self.shards:
            shard = load_file(self.folder / name)
            offsets = shard.pop("offsets").tolist()
            for start, end in zip(offsets[:-1], offsets[1:], strict=True):
                entries.append({key: value[start:end] for key, value in shard.items()})
        newest = dict(zip(self.done, entries, strict=True))
        return [newest[cid] for cid in self.ordered_ids(ids)]


@torch.no_grad()
def capture_features(
    model,
    conversations: list[Conversation],
    data_dir: str | os.PathLike | None = None,
    *,
    target: str = "",
    topk: int | None = None,
    shard_tokens: int = 65536,
    logits_chunk: int = 256,
    progress: bool = True,
) -> FeatureStore:
    """Capture features of `conversations` not captured yet into `<data_dir>/features`, keeping the target's
    `topk` most likely next tokens per position (None: as many as the store already keeps, 16 for a new one)."""
    folder = Path(data_dir or default_data_dir(target or model.name_or_path)) / "features"
    folder.mkdir(parents=True, exist_ok=True)
    store = FeatureStore.open(folder)
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
    store.topk, store.fingerprint = topk, fingerprint
    parts = decoder_parts(model)
    captured = store.captured()
    todo = [c for c in conversations if captured.get(c.id) != len(c.input_ids)]
    pending: list[tuple[str, dict[str, torch.Tensor]]] = []
    bar = tqdm(total=len(todo), desc="target features", unit="conv", disable=not progress)
    for conv in todo:
        ids = torch.tensor([conv.input_ids])
        hidden = model.model(input_ids=ids.to(model.device)).last_hidden_state[0]  # [seq_len, H], post-norm
        ids_k, logp_k = [], []
        for start in range(0, hidden.shape[0], logits_chunk):
            logp = torch.log_softmax(parts.lm_head(hidden[start : start + logits_chunk]).float(), dim=-1)
            top = torch.topk(logp, topk, dim=-1)
            ids_k.append(top.indices.to("cpu", torch.int32))
            logp_k.append(top.values.to("cpu", torch.float16))
        mask = torch.zeros(ids.shape[1], dtype=torch.uint8)
        mask[len(conv.prompt_ids) :] = 1
        pending.append(
            (
                conv.id,
                {
                    "input_ids": ids[0].to(torch.int32),
                    "features": unit_features(hidden, parts.norm).to("cpu", torch.bfloat16),
                    "topk_ids": torch.cat(ids_k),
                    "topk_logp": torch.cat(logp_k),
                    "response_mask": mask,
                },
            )
        )
        bar.update(1)
        if sum(len(p[1]["input_ids"]) for p in pending) >= shard_tokens:
            _write_shard(store, pending)
            pending = []
    if pending:
        _write_shard(store, pending)
    bar.close()
    return store


def _write_shard(store: FeatureStore, pending: list[tuple[str, dict[str, torch.Tensor]]]) -> None:
    name = f"shard-{len(store.shards):05d}.safetensors"
    lengths = [len(p[1]["input_ids"]) for p in pending]
    tensors = {key: torch.cat([p[1][key] for p in pending]).contiguous() for key in pending[0][1]}
    tensors["offsets"] = torch.tensor([0] + lengths).cumsum(0)
    tmp = store.folder / (name + ".tmp")
    save_file(tensors, str(tmp))
    tmp.replace(store.folder / name)
    store.shards.append(name)
    store.done.extend(p[0] for p in pending)
    store.lengths.extend(lengths)
    store.num_tokens += sum(lengths)
    store.save_manifest()
