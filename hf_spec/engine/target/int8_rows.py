"""LLM.int8 targets (bitsandbytes `load_in_8bit`) verified row by row, as their one-token steps compute.

bitsandbytes' `Linear8bitLt` (with `llm_int8_threshold` > 0, the default 6.0) splits each input row into int8
columns and "outlier" columns kept in floating point, and it picks the outlier columns over ALL rows of a forward:
a column where any row reaches the threshold is taken in floating point for every row. A row's output therefore
depends on the other rows of its forward. `generate` feeds one token per step after the prompt, so each generated
row sees only its own outliers; a tree forward would compute a row with its siblings' outliers too, and greedy
decoding departs from the model's own within a few dozen tokens.

`row_local_int8(module)` makes every `Linear8bitLt` in `module` pick the outlier columns row by row, on the calling
thread: row r's columns are its own outliers, quantized as bitsandbytes quantizes a one-row input, and computed
with its int8 product, its dequantization and its floating-point correction (the same operations; only the
correction's floating-point sums run over more rows). The prompt is the one multi-row forward `generate` makes:
`prompt_forward(model, length)` around a prefill of the WHOLE prompt records each layer's outlier columns over the
prompt, and the row of the prompt's last token (the first root, at position `length - 1`) takes them again in the
forwards that recompute it.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import types
import weakref
from collections.abc import Iterator

import torch
from torch import nn

_local = threading.local()  # .depth: inside row_local_int8; .positions: the current layer's; .prompt: records
_lock = threading.Lock()
# layer -> blocks open on any thread
_users: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()
_hooks: dict[int, object] = {}  # id(decoder layer) -> its position pre-hook while some block is open


def outlier_layers(module: nn.Module) -> list[nn.Module]:
    """The bitsandbytes `Linear8bitLt` layers of `module` that pick outlier columns (threshold > 0) from
    inference-only int8 weights; `[]` when nothing matches (bitsandbytes is never imported here: a model with such
    layers imported it)."""
    bnb = sys.modules.get("bitsandbytes.nn")
    Linear8bitLt = getattr(bnb, "Linear8bitLt", None)  # noqa: N806 - the class's own name
    if Linear8bitLt is None:
        return []
    return [
        m
        for m in module.modules()
        if isinstance(m, Linear8bitLt) and m.state.threshold > 0 and not m.state.has_fp16_weights
    ]


def _outliers(x: torch.Tensor, threshold: float) -> torch.Tensor:
    """`(rows, in)` bool: the entries bitsandbytes takes as outliers (judged on the float16 cast, as it does)."""
    return x.reshape(-1, x.shape[-1]).to(torch.float16).abs() >= threshold


def row_local_forward(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`Linear8bitLt.forward` with each row's outlier columns its own (the first root's row also takes the prompt's
    columns while they are recorded); bitsandbytes' own forward on threads outside `row_local_int8`.

    Args:
        x: `torch.FloatTensor` of shape `(..., in_features)`.

    Returns:
        `torch.FloatTensor` of shape `(..., out_features)` in `x`'s dtype.
    """
    if not getattr(_local, "depth", 0):
        return type(layer).forward(layer, x)
    if layer.weight.CB is not None:  # the first call moves the int8 weight into the matmul state, as bnb does
        layer.init_8bit_state()
    state = layer.state
    if state.CB is None or layer.training or x.numel() == 0:  # nothing the one-row rule changes: bnb's own
        return type(layer).forward(layer, x)
    if layer.bias is not None and layer.bias.dtype != x.dtype:
        layer.bias.data = layer.bias.data.to(x.dtype)
    ops = torch.ops.bitsandbytes
    a = x.reshape(-1, x.shape[-1])  # [rows, in]
    outliers = _outliers(a, state.threshold)  # [rows, in] each row's own
    # bitsandbytes' one-row quantization, by its own kernel: outliers zeroed, absmax of the rest, round to int8
    kept = a.to(torch.float16).masked_fill(outliers, 0)
    quantized, row_stats, _ = ops.int8_vectorwise_quant.default(kept, 0.0)  # [rows, in] int8, [rows]
    root = _prompt_rows(layer, a.shape[0])
    if root is not None:  # the first root's row: the prompt's columns in floating point, as `generate`'s
        rows, columns = root
        outliers[rows.unsqueeze(1), columns.unsqueeze(0)] = True
        quantized[rows.unsqueeze(1), columns.unsqueeze(0)] = 0
    cb, scb = state.CB, state.SCB  # [out, in] int8 weight, [out] its row scales
    out = ops.int8_scaled_mm.default(quantized, cb, row_stats, scb, bias=layer.bias, dtype=a.dtype)
    columns = torch.argwhere(outliers.any(dim=0)).view(-1)  # [k]
    if columns.numel():
        sub_a = (a[:, columns] * outliers[:, columns]).contiguous()  # [rows, k], zero where not the row's own
        sub_b = ops.int8_vectorwise_dequant.default(cb[:, columns].contiguous(), scb)
        out = out.addmm(sub_a, sub_b.to(a.dtype).t())
    return out.reshape(*x.shape[:-1], cb.shape[0])


def _prompt_rows(layer: nn.Module, rows: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`(row indices, prompt columns)` of this forward's rows at the first root's position, if recorded."""
    record = getattr(_local, "prompt", {}).get(id(layer))
    positions = getattr(_local, "positions", None)
    if record is None or positions is None or positions.numel() != rows:
        return None
    position, columns = record
    hit = torch.argwhere(positions.reshape(-1) == position).view(-1)
    return (hit, columns.to(hit.device)) if hit.numel() and columns.numel() else None


def _positions_hook(_module: nn.Module, _args: tuple, kwargs: dict) -> None:
    if getattr(_local, "depth", 0):
        _local.positions = kwargs.get("position_ids")


def _decoder_layers(module: nn.Module, layers: list[nn.Module]) -> list[nn.Module]:
    """The entries of `nn.ModuleList`s in `module` that hold some of `layers` (the decoder layers, whose forward
    gets `position_ids`)."""
    wanted = {id(m) for m in layers}
    return [
        block
        for child in module.modules()
        if isinstance(child, nn.ModuleList)
        for block in child
        if any(id(m) in wanted for m in block.modules())
    ]


def _patchable(layer: nn.Module) -> bool:
    forward = layer.__dict__.get("forward")
    return forward is None or getattr(forward, "__func__", None) is row_local_forward


@contextlib.contextmanager
def row_local_int8(module: nn.Module) -> Iterator[None]:
    """Inside the block the `Linear8bitLt` layers of `module` compute each row of this thread's forwards as a
    one-row forward would (blocks nest, and threads outside any block keep bitsandbytes' forward)."""
    # a layer whose forward another wrapper replaced (accelerate's offloading hook) keeps it: bitsandbytes' own
    # forward then, which the tree check's row probe refuses by name
    layers = [m for m in outlier_layers(module) if _patchable(m)]
    if not layers:
        yield
        return
    blocks = _decoder_layers(module, layers)
    with _lock:
        for m in layers:
            _users[m] = _users.get(m, 0) + 1
            m.__dict__["forward"] = types.MethodType(row_local_forward, m)
        for block in blocks:
            if id(block) not in _hooks:
                _hooks[id(block)] = block.register_forward_pre_hook(_positions_hook, with_kwargs=True)
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1
        if not _local.depth:
            _local.positions = None
        with _lock:
            for m in layers:
                _users[m] -= 1
                if not _users[m]:
                    m.__dict__.pop("forward", None)
            if not any(_users.get(m) for m in layers):
                for block in blocks:
                    hook = _hooks.pop(id(block), None)
                    if hook is not None:
                        hook.remove()


@contextlib.contextmanager
def prompt_forward(model: nn.Module, length: int, record: bool = True) -> Iterator[None]:
    """Around the prefill forward of a prompt of `length` tokens: forget earlier records of this thread and, with
    `record`, keep the outlier columns bitsandbytes picks over the prefill's rows in each `Linear8bitLt` of
    `model`, for the row at position `length - 1` in later forwards of this thread."""
    records: dict[int, tuple[int, torch.Tensor]] = {}
    _local.prompt = records

    def keep(layer: nn.Module, args: tuple) -> None:
        columns = torch.argwhere(_outliers(args[0], layer.state.threshold).any(dim=0)).view(-1)
        records[id(layer)] = (length - 1, columns)

    hooks = [m.register_forward_pre_hook(keep) for m in outlier_layers(model)] if record else []
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
