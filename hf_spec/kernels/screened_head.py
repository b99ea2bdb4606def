"""Exact greedy verification with a quarter of the LM head's bytes: screen with int8 weights, rescore in fp32.

A greedy verification needs each row's argmax over the vocabulary, not the logits. Qwen2.5-0.5B's fp32 LM head is
545 MB, read from DRAM on every verification (~20 ms of ~100 ms on a 2-core CPU). Here the int8 copy `q` (per-row
scale `s`) scores every token, a proven error bound keeps every token that could still be the argmax, and only
those rows of the fp32 weight are multiplied again; all other logits are returned as -inf. The argmax is the one
the fp32 head gives (up to fp32 rounding, as with any kernel):

    for token j, a_j = fl(x . q_j) * s_j and t_j = x . w_j:   |a_j - t_j| <= e_j = |x|_2 * c_j,
    c_j = (|s_j q_j - w_j|_2 + K 2^-24 (|w_j|_2 + |s_j q_j|_2) + 2^-22 |s_j q_j|_2) * (1 + 1e-3)

(Cauchy-Schwarz for the int8 error, fp32 sums and the final multiply by s_j as rounding terms),

so the true argmax j* has a_j* + e_j* >= t_j* >= t_k >= a_k - e_k for every k: it is among the candidates
{j : a_j + e_j >= max_k (a_k - e_k)}. On Qwen2.5-Coder-0.5B's verification rows a few dozen tokens pass.

Only where nothing but the argmax is read (greedy, no logits processors, no scores returned; stopping criteria are
then handed no scores, as in plain decoding: `screening_applies`); anything else gets the full fp32 head.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import types
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from hf_spec.kernels import cpu_skinny_gemm
from hf_spec.kernels.skinny_linear import skinny_linear

# rows of x screened: from ~9 rows both kernels are compute-bound and int8 weights stop paying (AMD EPYC, 2 threads)
MAX_ROWS = 6
_F32_EPS = 2.0**-24


@dataclass
class Int8Screen:
    """The int8 copy of a `(vocab, hidden)` fp32 weight with each row's error coefficient `c_j`."""

    weight: torch.Tensor  # (N, K) fp32, the original
    q: torch.Tensor  # (N, K) int8
    scale: torch.Tensor  # (N,) fp32
    coef: torch.Tensor  # (N,) fp32, c_j of the module docstring
    coef_max: float
    version: tuple[int, int]  # the weight's (data_ptr, _version) when built: a changed weight rebuilds

    @classmethod
    @torch.no_grad()
    def from_weight(cls, weight: torch.Tensor, chunk: int = 8192) -> Int8Screen:
        n, k = weight.shape
        q = torch.empty(n, k, dtype=torch.int8)
        scale = torch.empty(n, dtype=torch.float32)
        coef = torch.empty(n, dtype=torch.float32)
        gamma = k * _F32_EPS
        for start in range(0, n, chunk):  # a chunk at a time: bounded memory
            w = weight[start : start + chunk].float()
            s = (w.abs().amax(dim=1) / 127).clamp_(min=1e-12)
            qi = torch.round(w / s[:, None]).clamp_(-127, 127)
            deq = qi * s[:, None]
            dq_norm = deq.norm(dim=1)
            # fp32 norms are off by ~K 2^-24 relatively, far inside the 1e-3 margin; 2^-22 |s q_j| bounds the
            # rounding of the final multiply by s_j (|a_j| <= |x| |s q_j|)
            c = deq.sub_(w).norm(dim=1) + gamma * (w.norm(dim=1) + dq_norm) + 2.0**-22 * dq_norm
            q[start : start + chunk] = qi.to(torch.int8)
            scale[start : start + chunk] = s
            coef[start : start + chunk] = c * (1 + 1e-3)
        return cls(weight, q, scale, coef, float(coef.max()), _version(weight))

    def candidates(self, x: torch.Tensor) -> torch.Tensor | None:
        """Token ids that may hold some row's argmax of `x @ weight.T`, x `(M, K)` fp32; None without the kernel."""
        approx = cpu_skinny_gemm.kernel_linear_int8(x, self.q, self.scale)  # (M, N)
        if approx is None:
            return None
        xn = x.norm(dim=1) * (1 + 1e-4)  # (M,)
        best, arg = approx.max(dim=1)
        floor = best - xn * self.coef[arg]  # <= max_k (a_k - e_k)
        # every j with a_j + e_j >= floor has a_j >= floor - |x| max_j c_j: a cheap superset first
        pre = (approx >= (floor - xn * self.coef_max)[:, None]).any(dim=0).nonzero().flatten()
        keep = (approx[:, pre] + xn[:, None] * self.coef[pre][None] >= floor[:, None]).any(dim=0)
        return pre[keep]

    def top1_logits(self, x: torch.Tensor) -> torch.Tensor | None:
        """Logits `(..., N)` exact (fp32) at the candidates, -inf elsewhere; None where screening does not apply."""
        x2 = x.reshape(-1, x.shape[-1])
        if not 1 <= x2.shape[0] <= MAX_ROWS or x.dtype != torch.float32:
            return None
        x2 = x2.contiguous()
        if not bool(torch.isfinite(x2).all()):  # the bound needs finite inputs: the full head decides
            return None
        idx = self.candidates(x2)
        if idx is None:
            return None
        exact = skinny_linear(x2, self.weight.index_select(0, idx))  # (M, C)
        out = torch.full((x2.shape[0], self.weight.shape[0]), float("-inf"))
        out[:, idx] = exact
        return out.view(*x.shape[:-1], -1)


_screens: weakref.WeakKeyDictionary[nn.Module, Int8Screen] = weakref.WeakKeyDictionary()


def _version(weight: torch.Tensor) -> tuple[int, int]:
    return weight.data_ptr(), weight._version


def screen_for(head: nn.Linear) -> Int8Screen:
    """The module's int8 screen, built on first use (~1 s for a 151,936 x 896 head) and when its weight changed."""
    screen = _screens.get(head)
    if screen is None or screen.version != _version(head.weight):
        screen = _screens[head] = Int8Screen.from_weight(head.weight.detach())
    return screen


def screening_disabled() -> bool:
    """`HF_SPEC_SCREENED_HEAD=0` turns screening off (read on every call)."""
    return os.environ.get("HF_SPEC_SCREENED_HEAD", "").strip().lower() in ("0", "false", "no")


def screening_applies(model: nn.Module, do_sample: bool, has_processors: bool, returns_scores: bool) -> bool:
    """Whether only the verification rows' argmax is ever read, and the model's head can be screened here.
    (Stopping criteria see scores only where they are returned, as in plain decoding.)"""
    if do_sample or has_processors or returns_scores or screening_disabled():
        return False
    head = model.get_output_embeddings()
    if type(head) is not nn.Linear or head.bias is not None:
        return False
    w = head.weight
    return (
        w.dtype == torch.float32 and w.is_cpu and w.dim() == 2 and cpu_skinny_gemm.load_kernel() is not None
    )


def _screened_forward(self: nn.Linear, x: torch.Tensor, owner: int = 0) -> torch.Tensor:
    if threading.get_ident() == owner and not torch.is_grad_enabled():
        out = screen_for(self).top1_logits(x)
        if out is not None:
            return out
    return skinny_linear(x, self.weight, self.bias)


@contextlib.contextmanager
def screened_lm_head(model: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Inside the block the model's LM head returns `Int8Screen.top1_logits` for 1..`MAX_ROWS` rows (caller checked
    `screening_applies`); other row counts, and calls from other threads (an asynchronous drafter's), get the full
    head (by `skinny_linear`)."""
    head = model.get_output_embeddings() if enabled else None
    if head is None or "forward" in head.__dict__:
        yield
        return
    head.__dict__["forward"] = types.MethodType(
        functools.partial(_screened_forward, owner=threading.get_ident()), head
    )
    try:
        yield
    finally:
        head.__dict__.pop("forward", None)
