"""Training on from an existing head (`hf-spec train eagle|lyanna|eagle3 --init-from HEAD`): the checks that the
head can go on training under this run's config, and the report entry that says where the training started."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import nn

# the files of a head folder that hold hf-spec's training report, and the key it is under (None: the whole file)
REPORT_FILES = (("training_report.json", None), ("hf_spec.json", "training"), ("config.json", "training"))


def train_on_from(head: nn.Module, fresh: Any, fields: tuple[str, ...], what: str) -> nn.Module:
    """`head` (a loaded hf-spec head of the kind being trained) ready to train on: float32, keeping its draft
    vocabulary (`d2t`), which the shared trainer then leaves as it is. `fresh`: the config this run would give a
    new head; its draft vocabulary size and `fields` (the head's shape options) must be the head's, else
    `ValueError` naming the difference."""
    for field in fields:
        have, want = getattr(head.config, field, None), getattr(fresh, field, None)
        if have != want:
            raise ValueError(
                f"the head to start from has {field}={have!r}, this run asks for {want!r}: train on with the "
                f"head's own setting or train a new {what}"
            )
    check_draft_vocabulary(head.config.draft_vocab_size, fresh.draft_vocab_size, what)
    head = head.float().train()
    head.keeps_its_vocabulary = True
    return head


def check_draft_vocabulary(size: int, wanted: int, what: str) -> None:
    """Refuse to train on from a head with a `size`-token draft vocabulary under a run asking for `wanted`."""
    if size != wanted:
        raise ValueError(
            f"the head to start from has a {size}-token draft vocabulary, the training config asks for {wanted}: "
            f"leave --draft-vocab out (the head's own is kept) or train a new {what}"
        )


def saved_training_report(folder: str | Path) -> dict[str, Any] | None:
    """The training report hf-spec saved with the head in `folder` (a local folder), or None (a head trained
    elsewhere, or saved without one)."""
    for name, key in REPORT_FILES:
        try:
            data = json.loads((Path(folder) / name).read_text())
        except (OSError, ValueError):
            continue
        report = data.get(key) if key and isinstance(data, dict) else data
        if isinstance(report, dict) and "config" in report:
            return report
    return None


def started_from(init_from: str | None) -> dict[str, Any]:
    """`{"started_from": {"head": HEAD, "training": its training report}}` for `--init-from HEAD`, so the report
    and card of a head trained on from another show the whole training (the report is the one hf-spec saved with
    the start head, absent for heads trained elsewhere); `{}` without `--init-from`."""
    if not init_from:
        return {}
    from hf_spec.core.hub_ids import resolve_head_folder

    report = saved_training_report(resolve_head_folder(init_from, "head"))
    entry: dict[str, Any] = {"head": init_from}
    if report is not None:
        entry["training"] = {k: v for k, v in report.items() if k != "history"}
    return {"started_from": entry}
