"""How often a trained draft head agrees with its target, by draft depth, on stored features: the held-out figure
every training report gives, for any head (ours or published) on any captured data.

Depth d is the top-1 agreement with the target's token d positions ahead, the head reading its own states from
depth 2 on with the attention mask drafting sees (the training-time unroll of the head's trainer, without
gradients, in float32); one figure per sequence, averaged over sequences, as the training reports do.
"""

from __future__ import annotations

from typing import Any

import torch

METHODS = ("eagle", "eagle3", "lyanna")


def head_method(head_path: str) -> str | None:
    """How the head `head_path` (a folder or Hub id) drafts, from its own files: the method of its recipe
    (`hf_spec_config.json`, in every folder hf-spec saves), else `eagle3` for a published EAGLE-3 checkpoint;
    None when they do not say."""
    import json
    from pathlib import Path

    from hf_spec.core.hub_ids import HEAD_CONFIG_FILES, resolve_folder

    folder = Path(resolve_folder(head_path, "head", HEAD_CONFIG_FILES))

    def read(name: str) -> dict:
        try:
            data = json.loads((folder / name).read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    method = read("hf_spec_config.json").get("method")
    if method in METHODS:
        return method
    config = read("config.json")
    if config.get("speculators_model_type") == "eagle3" or any(
        "Eagle3" in a for a in config.get("architectures") or ()
    ):
        return "eagle3"
    return None


def load_for_evaluation(method: str, head_path: str, target) -> Any:
    """The head `head_path` names (a folder or Hub id), loaded for `target` as `method` decodes with it."""
    if method == "eagle3":
        from hf_spec.methods.eagle3 import load_eagle3_head

        return load_eagle3_head(head_path, target)
    from hf_spec.methods.head_drafter import load_draft_head

    if method == "eagle":
        from hf_spec.methods.eagle.modeling import EagleHeadModel as head_cls
    elif method == "lyanna":
        from hf_spec.methods.lyanna.modeling import LyannaHeadModel as head_cls
    else:
        raise ValueError(f"no agreement evaluation for method {method!r}: one of {', '.join(METHODS)}")
    return load_draft_head(head_cls, head_path, target, method)


def head_agreement(
    method: str,
    head: Any,
    target,
    sequences: list[dict],
    depths: int = 4,
    max_len: int = 1024,
    store_layers: tuple[int, ...] | None = None,
) -> dict:
    """`{"accuracy_by_depth": [...], "sequences": n}`: `head` (loaded by `load_for_evaluation`) against `target`
    on `sequences` (a feature store's, with the keys the method's trainer reads), at depths 1..`depths` (at least
    4). `store_layers`: the target layers the store's `aux_features` hold (EAGLE-3 heads must read those)."""
    from hf_spec.training.trainer import evaluate

    if not sequences:
        raise ValueError("no sequences to evaluate the head on")
    if method == "eagle3" and tuple(head.config.hidden_state_indices) != tuple(store_layers or ()):
        raise ValueError(
            f"the head reads target layers {list(head.config.hidden_state_indices)}, the features hold layers "
            f"{list(store_layers or ())}: capture features with the head's layers (`hf-spec data features "
            "--aux-layers I,J,K`)"
        )
    model, cfg, step_fn = _trainee(method, head, target, depths, max_len)
    model = model.float().eval()
    t2d = torch.full(
        (target.get_input_embeddings().weight.shape[0],), -1, dtype=torch.long, device=model.d2t.device
    )
    t2d[model.d2t] = torch.arange(len(model.d2t), device=t2d.device)
    result = evaluate(model, sequences, cfg, t2d, step_fn)
    return {"accuracy_by_depth": result["accuracy_by_depth"], "sequences": len(sequences)}


def _trainee(method: str, head: Any, target, depths: int, max_len: int):
    """`(module the trainer's step runs, its config, its step function)` for `method`'s head."""
    common = {"align_steps": depths, "max_len": max_len, "draft_vocab": head.config.draft_vocab_size}
    if method == "eagle3":
        from hf_spec.models.fingerprint import target_fingerprint
        from hf_spec.training.eagle3 import Eagle3TrainConfig, Eagle3Trainee, eagle3_step

        trainee = Eagle3Trainee(head.float(), target_fingerprint(target), trained=True).attach_target(target)
        return trainee, Eagle3TrainConfig(**common), eagle3_step
    if method == "eagle":
        from hf_spec.training.eagle import EagleTrainConfig, head_step

        return head, EagleTrainConfig(**common, architecture=head.layout), head_step  # attached by its loader
    from hf_spec.training.lyanna import LyannaTrainConfig, lyanna_step

    return head, LyannaTrainConfig(**common), lyanna_step


def held_out_from_training(head: str, ids: list[str]) -> bool:
    """Whether the training report saved with `head` (and with every head it was trained on from) lists `ids`
    among its held-out sequences."""
    from hf_spec.core.hub_ids import resolve_head_folder
    from hf_spec.training.warm_start import saved_training_report

    report = saved_training_report(resolve_head_folder(head, "head"))
    while report is not None and set(ids) <= set(report.get("heldout_ids") or ()):
        start = report.get("started_from")
        if not start:
            return True
        report = start.get("training")  # None: a start head trained elsewhere, which says nothing
    return False
