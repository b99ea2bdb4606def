"""The loop every head trainer shares: draft vocabulary, AdamW with warm-up + decay, gradient clipping, one or
several processes (`accelerate launch`, `hf_spec.training.distributed`), a progress bar with loss and accuracy,
resumable checkpoints, a held-out evaluation."""

from __future__ import annotations

import contextlib
import functools
import json
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from hf_spec.training.batches import collate, draft_vocabulary, training_schedule, vocabulary_coverage
from hf_spec.training.distributed import current_processes, global_values, share_of_positions
from hf_spec.training.host_memory import keep_freed_memory
from hf_spec.training.loop import Checkpoint, warmup_linear_decay
from hf_spec.training.losses import soft_cross_entropy, topk_loss

# step_fn(head, batch, cfg, t2d) -> (loss, accuracy per draft depth, loss parts)
StepFn = Callable[..., tuple[torch.Tensor, list[float], dict[str, float]]]


def batch_on(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {key: value.to(device) for key, value in batch.items()}


@dataclass
class Unroll:
    """A batch laid out for unrolled draft depths. Query index i stands for position t = i + 1: input feature
    f_{t-1} = `f_in[:, i]`, token x_t = `ids[:, i]`, targets u_t and the target's logits at t (predicting x_{t+1}),
    `mask` 1 where x_{t+1} is an answer token."""

    f_in: torch.Tensor  # [B, n, H]
    ids: torch.Tensor  # [B, n]
    u_tgt: torch.Tensor  # [B, n, H]
    position_ids: torch.Tensor  # [B, n]
    mask: torch.Tensor  # [B, n]
    target_logits: torch.Tensor  # [B, n, V_draft]
    topk_ids: torch.Tensor  # [B, n, K0] draft ids of the target's top tokens (-1: outside the draft vocab)
    topk_logq: torch.Tensor  # [B, n, K0]

    @classmethod
    @torch.no_grad()
    def of(cls, head, batch: dict[str, torch.Tensor], t2d: torch.Tensor) -> Unroll:
        u, x = batch["features"], batch["input_ids"].long()
        B, T = x.shape
        n = T - 1
        ok = batch["valid"] & batch["response_mask"].bool()
        mask = torch.zeros(B, n, device=x.device)
        mask[:, : n - 1] = ok[:, 2:].float()
        return cls(
            f_in=u[:, :-1],
            ids=x[:, 1:],
            u_tgt=u[:, 1:],
            position_ids=torch.arange(1, T, device=x.device).expand(B, n),
            mask=mask,
            target_logits=head.draft_logits(u[:, 1:]),
            topk_ids=t2d[batch["topk_ids"][:, 1:].long()],
            topk_logq=batch["topk_logp"][:, 1:].float(),
        )

    def depth_mask(self, depth: int) -> torch.Tensor:
        """`mask` without the positions that have fewer than depth-1 predecessors."""
        m = self.mask.clone()
        m[:, : depth - 1] = 0
        return m

    @functools.cached_property
    def trained(self) -> torch.Tensor:
        """`(B, n)` bool: the rows any depth's loss reads (answers, not padding); `token_loss` takes `h[trained]`."""
        return self.mask > 0

    @functools.cached_property
    def _trained_targets(self) -> tuple[torch.Tensor, ...]:  # gathered once a batch, read at every depth
        return tuple(t[self.trained] for t in (self.target_logits, self.topk_ids, self.topk_logq))

    def token_loss(
        self, logp: torch.Tensor, depth: int, cfg: HeadTrainConfig, parts: dict[str, float]
    ) -> tuple[torch.Tensor, float]:
        """Depth `depth`'s loss from the head's log-probabilities `logp` `(B, n, V_draft)` or `(N, V_draft)` at the
        `trained` rows: `ce_weight` x soft cross-entropy (+ `topk_weight` x HASS top-K distillation with `cfg.topk`);
        returns `(loss, top-1 agreement)`, adds each part over `cfg.align_steps` to `parts`."""
        m, targets = self.depth_mask(depth), (self.target_logits, self.topk_ids, self.topk_logq)
        if logp.dim() == 2:
            m, targets = m[self.trained], self._trained_targets
        target, top_ids, top_logq = targets
        l_ce = soft_cross_entropy(logp, target, m)
        loss = cfg.ce_weight * l_ce
        parts["ce"] = parts.get("ce", 0.0) + l_ce.item() / cfg.align_steps
        if getattr(cfg, "topk", 0):
            l_top = topk_loss(logp, top_ids, top_logq, m, cfg.topk)
            loss = loss + cfg.topk_weight * l_top
            parts["topk"] = parts.get("topk", 0.0) + l_top.item() / cfg.align_steps
        with torch.no_grad():
            agreement = float(((logp.argmax(-1) == top_ids[..., 0]) * m).sum() / m.sum().clamp(min=1))
        return loss, agreement


@dataclass
class HeadTrainConfig:
    """Args:
    align_steps: draft depths unrolled per batch (HASS context alignment / Lyanna chain length; 1 = EAGLE).
    feature_weight / ce_weight: weights of the feature regression and the soft cross-entropy.
    draft_vocab: reduced draft vocabulary size (most frequent answer tokens).
    epochs: passes over the data. batch_tokens: padded tokens per batch. max_len: longest sequence kept.
    heldout: conversations held out for the evaluation. eval_every: also evaluate on them every N steps (0: at
    the end only). init_from_last_layer: warm-start the head's layer from the target's last layer.
    precision: "bf16" (autocast matmuls; master weights, softmax and losses stay fp32), "fp32", or "auto" (bf16
    where the hardware multiplies bf16 natively: CUDA, or a CPU with AMX / AVX512-BF16).
    The defaults weight the distribution term above the feature regression (CE 1.0, feature 0.1, lr 1e-3, a fresh
    layer): with little training data the distribution term has to lead.
    """

    align_steps: int = 1
    feature_weight: float = 0.1
    ce_weight: float = 1.0
    draft_vocab: int = 32768
    epochs: float = 4.0
    lr: float = 1e-3
    warmup: float = 0.03
    weight_decay: float = 0.0
    clip: float = 0.5
    batch_tokens: int = 2048
    max_len: int = 1024
    seed: int = 0
    save_every: int = 50
    heldout: int = 16
    eval_every: int = 0
    init_from_last_layer: bool = False
    precision: str = "auto"
    extra: dict = field(default_factory=dict)


_RESUMABLE_CHANGES = {"save_every", "precision", "eval_every"}  # settings a resumed run may change
_HEAD_CONFIG_BOOKKEEPING = {
    "transformers_version",
    "training",
    "auto_map",
    "architectures",
    "_name_or_path",
    "target",
}


def run_identity(head, cfg: HeadTrainConfig) -> dict:
    """What a checkpoint must match to be resumed: the training settings and the head's own config."""
    head_config = {k: v for k, v in head.config.to_dict().items() if k not in _HEAD_CONFIG_BOOKKEEPING}
    train = {k: v for k, v in asdict(cfg).items() if k not in _RESUMABLE_CHANGES}
    return json.loads(json.dumps({"training": train, "head": head_config}, default=str))


# settings added after runs were first recorded: a checkpoint without one was made with this value
_ADDED_SETTINGS = {"architecture": "hf-spec"}


def check_resumable(saved: dict | None, now: dict, out: Path) -> None:
    """Refuse to resume a checkpoint made with other settings (its weights, schedule or shapes would not fit);
    checkpoints from before the settings were recorded (`saved` None) are not checked."""
    if saved is None:
        return

    def was(part: str, key: str):
        return saved.get(part, {}).get(key, _ADDED_SETTINGS.get(key))

    changed = [
        f"{key} {was(part, key)!r} -> {now[part].get(key)!r}"
        for part in now
        for key in sorted(set(now[part]) | set(saved.get(part, {})))
        if now[part].get(key) != was(part, key)
    ]
    if changed:
        named = "; ".join(dict.fromkeys(changed))  # a setting of both the training and the head: named once
        raise ValueError(
            f"{out} holds a run with other settings ({named}): rerun with the same options to resume it, or "
            "give another --checkpoint-dir (or delete that folder) to start afresh"
        )


def autocast_dtype(precision: str, device: torch.device | str = "cpu") -> torch.dtype | None:
    """The autocast dtype for `precision` ("auto" | "bf16" | "fp32") on `device`; None = no autocast. "auto":
    bfloat16 on CUDA and on CPUs that multiply it natively."""
    if precision not in ("auto", "bf16", "fp32"):
        raise ValueError(f"precision must be auto, bf16 or fp32, got {precision!r}")
    kind = torch.device(device).type
    if precision == "fp32":
        return None
    if precision == "bf16":
        if not torch.amp.is_autocast_available(kind):
            raise ValueError(f"precision bf16: torch has no autocast on {kind!r}; use --dtype float32")
        return torch.bfloat16
    if kind == "cuda":
        return torch.bfloat16
    native = torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
    return torch.bfloat16 if kind == "cpu" and native else None


def split_heldout(
    sequences: list[dict], count: int, groups: list[str] | None = None
) -> tuple[list[dict], list[dict]]:
    """Every k-th prompt held out for evaluation (deterministic), with all its sequences: `groups[i]` names the
    prompt of `sequences[i]` (its greedy and sampled answers); default: each sequence its own prompt."""
    groups = groups if groups is not None else [str(i) for i in range(len(sequences))]
    if len(groups) != len(sequences):
        raise ValueError(f"{len(groups)} groups for {len(sequences)} sequences")
    prompts = list(dict.fromkeys(groups))  # in order of first appearance
    if count <= 0 or len(prompts) < 2 * count:
        return sequences, []
    stride = len(prompts) // count
    held = {prompts[i] for i in range(0, stride * count, stride)}
    return [s for s, g in zip(sequences, groups, strict=True) if g not in held], [
        s for s, g in zip(sequences, groups, strict=True) if g in held
    ]


@torch.no_grad()
def evaluate(head, sequences, cfg: HeadTrainConfig, t2d: torch.Tensor, step_fn: StepFn) -> dict:
    """Held-out top-1 agreement with the target per draft depth (at least 4 depths), and loss."""
    if not sequences:
        return {}
    eval_cfg = replace(cfg, align_steps=max(cfg.align_steps, 4))
    totals, losses = [0.0] * eval_cfg.align_steps, []
    for seq in sequences:
        loss, accs, _ = step_fn(head, batch_on(collate([seq], cfg.max_len), t2d.device), eval_cfg, t2d)
        losses.append(loss.item())
        totals = [a + b for a, b in zip(totals, accs, strict=True)]
    return {
        "loss": sum(losses) / len(losses),
        "accuracy_by_depth": [round(t / len(sequences), 4) for t in totals],
    }


def evaluate_during_training(head, heldout, cfg, t2d, step_fn, step: int, extra: dict, bar) -> float:
    """`evaluate` at `step` of a run (`cfg.eval_every`): recorded in `extra["evals"]` (the checkpoint's, so a
    resumed run keeps it) and shown above the progress bar; returns the seconds it took, which the run's
    throughput leaves out."""
    began = time.perf_counter()
    result = evaluate(head.eval(), heldout, cfg, t2d, step_fn)
    head.train()
    extra.setdefault("evals", []).append({"step": step} | result)
    bar.write(f"step {step}: held-out agreement by depth {result['accuracy_by_depth']}")
    return time.perf_counter() - began


def train_head(
    target,
    head,
    sequences: list[dict],
    out: str | Path,
    cfg: HeadTrainConfig,
    step_fn: StepFn,
    progress: bool = True,
    groups: list[str] | None = None,
    heldout: list[dict] | None = None,
):
    """Train (or resume) the fresh `head` for `target` on captured `sequences`; returns `(head, report)`.
    `groups`: the prompt of each sequence, so that a held-out prompt's sampled answers are held out too.
    `heldout`: a fixed held-out set to evaluate on (`training/store_data.py`), all of `sequences` trained on;
    None: every k-th prompt of `sequences` is held out (`split_heldout`, `cfg.heldout` of them). Under
    `accelerate launch` each process trains on its share of every global batch (`hf_spec.training.distributed`);
    only the main process writes the checkpoint, shows progress and evaluates (the others' report has no
    `heldout` results)."""
    processes = current_processes()
    torch.manual_seed(cfg.seed)
    out = Path(out)
    train_set, heldout = (
        split_heldout(sequences, cfg.heldout, groups) if heldout is None else (sequences, heldout)
    )
    if cfg.heldout and not heldout:
        warnings.warn(
            f"--heldout {cfg.heldout} needs at least {2 * cfg.heldout} prompts, the data has fewer: "
            "training without a held-out evaluation",
            stacklevel=2,
        )
    vocab_size = target.get_input_embeddings().weight.shape[0]
    eos = target.generation_config.eos_token_id
    keep = [eos] if isinstance(eos, int) else list(eos or [])
    checkpoint = Checkpoint(out / "checkpoint")
    identity = run_identity(head, cfg)
    if checkpoint.exists():
        saved = checkpoint.peek_extra()
        check_resumable(saved.get("run"), identity, out)
        head.d2t.copy_(torch.tensor(saved["d2t"]))
    elif not getattr(head, "keeps_its_vocabulary", False):  # a head trained on from its own weights keeps it
        head.d2t.copy_(draft_vocabulary(train_set, head.config.draft_vocab_size, vocab_size, keep))
        if cfg.init_from_last_layer:
            head.init_layer_from(target, -1)
    head.attach_target(target)  # the head trains where the target is
    if (device := head.d2t.device).type == "cpu":
        keep_freed_memory()  # each step's large tensors reuse the last step's pages (training/host_memory.py)
    t2d = torch.full((vocab_size,), -1, dtype=torch.long, device=device)
    t2d[head.d2t] = torch.arange(len(head.d2t), device=device)
    coverage = vocabulary_coverage(heldout or train_set, head.d2t, vocab_size)  # held-out when there is one

    lengths = [min(len(s["input_ids"]), cfg.max_len) for s in train_set]
    schedule = training_schedule(lengths, cfg.batch_tokens, cfg.seed, cfg.epochs)
    if not schedule:
        raise ValueError(
            f"nothing to train: epochs must be positive (got {cfg.epochs}) and the data non-empty"
        )
    total_steps = len(schedule)
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    scheduler = warmup_linear_decay(optimizer, total_steps, int(cfg.warmup * total_steps))
    data = {"conversations": len(train_set), "tokens": sum(lengths)}
    step, extra = (
        0,
        {"d2t": head.d2t.tolist(), "history": [], "wall_seconds": 0.0, "data": data, "run": identity},
    )
    if checkpoint.exists():
        step, extra = checkpoint.load(head, optimizer, scheduler)
        if extra.get("data", data) != data:  # runs checkpointed before the data was recorded: not checked
            raise ValueError(
                f"{out} holds a run on other data ({extra['data']}, now {data}): its schedule and draft vocabulary "
                "do not fit; delete that folder (or give another --checkpoint-dir) to start afresh"
            )
        head.attach_target(target)
    runs = extra.setdefault("num_processes", [])  # how many processes trained from which step
    if not runs or runs[-1]["processes"] != processes.world:
        runs.append({"from_step": step, "processes": processes.world})
    processes.barrier()  # every process has read the checkpoint before the main one writes the next
    amp = autocast_dtype(cfg.precision, device)
    head.train()

    bar = tqdm(
        total=total_steps,
        initial=step,
        desc=f"train {type(head).__name__}",
        unit="step",
        disable=not (progress and processes.is_main),
    )
    started, tokens_seen = time.perf_counter(), 0
    wall_before = extra["wall_seconds"]
    while step < total_steps:
        mine, counts = processes.shard(schedule[step])
        batch = batch_on(collate([train_set[i] for i in mine], cfg.max_len), device)
        autocast = torch.autocast(device.type, dtype=amp) if amp is not None else contextlib.nullcontext()
        with autocast:
            loss, accs, parts = step_fn(head, batch, cfg, t2d)
        # this process's share of the global batch's loss positions (1 with one process): the weighted sum of
        # the processes' losses is the global batch's loss
        weight = share_of_positions(batch, counts, processes)
        optimizer.zero_grad(set_to_none=True)
        (loss * weight if processes.world > 1 else loss).backward()
        processes.sum_gradients(params)
        torch.nn.utils.clip_grad_norm_(params, cfg.clip)
        optimizer.step()
        scheduler.step()
        step += 1
        loss_value, accs, parts = global_values(loss.item(), accs, parts, weight, processes)
        tokens_seen += int(processes.total(int(batch["valid"].sum()) if counts else 0))
        elapsed = time.perf_counter() - started
        bar.update(1)
        bar.set_postfix(loss=f"{loss_value:.3f}", acc=f"{accs[0]:.3f}", tok_s=f"{tokens_seen / elapsed:.0f}")
        extra["history"].append(
            {"step": step, "loss": round(loss_value, 4), "acc": [round(a, 4) for a in accs]}
            | {k: round(v, 4) for k, v in parts.items()}
        )
        extra["wall_seconds"] = wall_before + elapsed
        if (
            cfg.eval_every
            and step % cfg.eval_every == 0
            and step < total_steps
            and heldout
            and processes.is_main
        ):
            started += evaluate_during_training(head, heldout, cfg, t2d, step_fn, step, extra, bar)
        if processes.is_main and (step % cfg.save_every == 0 or step == total_steps):
            checkpoint.save(head, optimizer, scheduler, step, extra)
    bar.close()
    processes.barrier()  # the last checkpoint is written before any process goes on
    head = head.eval()
    seen = sum(lengths[i] for batch in schedule for i in batch)
    report = {
        "config": asdict(cfg),
        "steps": total_steps,
        "epochs": cfg.epochs,
        "train_conversations": len(train_set),
        "train_tokens": sum(lengths),
        "heldout_conversations": len(heldout),
        "draft_vocab_coverage": round(coverage, 4),
        "draft_vocab_coverage_on": "held-out" if heldout else "training",
        "wall_seconds": round(extra["wall_seconds"]),
        # answer and context tokens the steps ran over (every epoch, every process), per second of training
        "tokens_seen": seen,
        "tokens_per_second": round(seen / max(extra["wall_seconds"], 1e-9), 1),
        "final_loss": extra["history"][-1]["loss"] if extra["history"] else None,
        "first_loss": extra["history"][0]["loss"] if extra["history"] else None,
        "num_processes": processes.world,
        "num_processes_by_step": extra["num_processes"],  # a resumed run may have changed it
        "global_batch_tokens": cfg.batch_tokens,  # padded tokens per optimizer step, over all processes
        "heldout": evaluate(head, heldout, cfg, t2d, step_fn) if processes.is_main else {},
        "heldout_by_step": extra.get("evals", []),  # with --eval-every
    }
    return head, report
