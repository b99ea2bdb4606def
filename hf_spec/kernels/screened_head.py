"""Exact greedy verification with a quarter of the LM head's bytes: screen with int8 weights, rescore exactly.

A greedy verification needs each row's argmax over the vocabulary, not the logits, and a small model's LM head is
its largest weight, read from DRAM on every verification. Here the int8 copy `q` (per-row scale `s`) scores every
token, a proven error bound keeps every token that could still be the argmax, and only those rows of the fp32
weight are multiplied again; all other logits are returned as -inf. The argmax is the one the fp32 head gives (up
to fp32 rounding, as with any kernel):

    for token j, a_j = fl(x . q_j) * s_j and t_j = x . w_j:   |a_j - t_j| <= e_j = |x|_2 * c_j,
    c_j = (|s_j q_j - w_j|_2 + K 2^-24 (|w_j|_2 + |s_j q_j|_2) + 2^-22 |s_j q_j|_2) * (1 + 1e-3)

(Cauchy-Schwarz for the int8 error, fp32 sums and the final multiply by s_j as rounding terms),

so the true argmax j* has a_j* + e_j* >= t_j* >= t_k >= a_k - e_k for every k: it is among the candidates
{j : a_j + e_j >= max_k (a_k - e_k)}; on a confident row a few dozen tokens pass.

With AVX512-VNNI, from 3 rows x is quantized too, in two int8 levels per row (the second quantizes what the first
left), x = s_1 q_1 + s_2 q_2 + r, and the kernel sums the integer products q_l . q_j exactly (`vpdpbusd`: 64
products an instruction against 16 fp32 FMAs). The first level scores every token, a_j = fl(fl(q_1 . q_j) *
fl(s_j s_1)), with

    |a_j - t_j| <= |x|_2 c_j + (|x - s_1 q_1|_2 + 2^-22 |s_1 q_1|_2) |s_j q_j|_2

(x . (w_j - s_j q_j) and (x - s_1 q_1) . s_j q_j by Cauchy-Schwarz, three roundings of the product): x's outlier
channels leave |x - s_1 q_1| at a few % of |x|, so this keeps more tokens (about a hundred a row, thousands on
uncertain rows). The second level adds fl(fl(q_2 . q_j) * fl(s_j s_2)) for those tokens only, bound |x|_2 c_j +
(|r|_2 + 2^-21 (|s_1 q_1|_2 + |s_2 q_2|_2)) |s_j q_j|_2 with |r| ~1e-4 |x|: as few candidates as fp32 x.

A bfloat16 head (on AVX512-BF16 CPUs) is screened the same way, x widened to fp32 and the bound unchanged (hf-spec's
bf16 kernel sums in fp32 too); its logits are then rounded to bfloat16, where two tokens may tie and the lower id
wins, so every token that may round to the top value is kept as well (the floor lowered by 2^-6 of itself) and the
candidates are rescored by the bf16 kernel: the argmax the full bf16 head gives on that kernel (where torch's GEMM
runs the full head instead, as on CPUs with AMX tiles, the two sum in other orders: they may differ at a bfloat16
near-tie, as torch's paths do among themselves). Where torch's GEMM runs the full bf16 head faster than hf-spec's
kernel (`bf16_kernel_rows()` below 13), only up to `BF16_SCREEN_ROWS` rows are screened.

Only where nothing but the argmax is read (greedy, no logits processors, no scores returned; stopping criteria are
then handed no scores, as in plain decoding: `screening_applies`); anything else gets the full head.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import types
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from hf_spec.core import envs
from hf_spec.kernels import cpu_skinny_gemm
from hf_spec.kernels.skinny_linear import BF16_MAX_ROWS, bf16_kernel_rows, skinny_linear

# rows of x screened with fp32 x (with more, the int8 kernel is compute-bound and screening stops paying); with
# AVX512-VNNI, from MIN_ROWS_VNNI rows x is quantized to int8 too and up to MAX_ROWS_VNNI rows are screened, for heads
# of at least INT8_X_MIN_WEIGHTS weights (on a smaller head, quantizing x costs more than the saved bytes)
MAX_ROWS, MAX_ROWS_VNNI, MIN_ROWS_VNNI = 6, 32, 3
# bfloat16 rows screened where torch's GEMM, not hf-spec's bf16 kernel, runs the full head on 13 rows (AMX tiles)
BF16_SCREEN_ROWS = 12
INT8_X_MIN_WEIGHTS = 64 * 2**20
_F32_EPS = 2.0**-24
BF16_ROUNDING = 2.0**-8  # bfloat16's relative rounding step (8 significant bits: at most half of 2^-7)


@dataclass
class Int8Screen:
    """The int8 copy of a `(vocab, hidden)` fp32 weight with each row's error coefficient `c_j`."""

    weight: torch.Tensor  # (N, K) fp32, the original
    q: torch.Tensor  # (N, K) int8
    scale: torch.Tensor  # (N,) fp32
    coef: torch.Tensor  # (N,) fp32, c_j of the module docstring
    qsum: torch.Tensor  # (N,) int32, sum_k q_jk (the VNNI kernel's offset)
    qnorm: torch.Tensor  # (N,) fp32, |s_j q_j|_2 rounded up
    version: tuple[int, int]  # the weight's (data_ptr, _version) when built: a changed weight rebuilds

    @classmethod
    @torch.no_grad()
    def from_weight(cls, weight: torch.Tensor, chunk: int = 8192) -> Int8Screen:
        n, k = weight.shape
        q = torch.empty(n, k, dtype=torch.int8)
        scale, coef, qnorm = (torch.empty(n, dtype=torch.float32) for _ in range(3))
        qsum = torch.empty(n, dtype=torch.int32)
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
            qsum[start : start + chunk] = qi.sum(dim=1).to(torch.int32)
            qnorm[start : start + chunk] = dq_norm * (1 + 1e-3)
        return cls(weight, q, scale, coef, qsum, qnorm, _version(weight))

    def candidates(self, x: torch.Tensor, rounding: float = 0.0) -> torch.Tensor | None:
        """Token ids that may hold some row's argmax of `x @ weight.T`, x `(M, K)` fp32, also where the logits are
        then rounded with a relative step of `rounding` (a tie after rounding goes to the lowest id: every token
        that may round to the top value is kept); None without the kernel."""
        xn = x.norm(dim=1) * (1 + 1e-4)  # (M,)
        if x.shape[0] >= MIN_ROWS_VNNI and int8_x_applies(self.q.numel()):
            return self._candidates_int8_x(x, xn, rounding)
        approx = cpu_skinny_gemm.kernel_linear_int8(x, self.q, self.scale)  # (M, N)
        if approx is None:
            return None
        return _within_bound(approx, xn, torch.zeros_like(xn), self.coef, self.qnorm, rounding)

    def _candidates_int8_x(self, x: torch.Tensor, xn: torch.Tensor, rounding: float) -> torch.Tensor | None:
        """x quantized per row in two int8 levels (`int8_levels`): the first scores every token (loose bound), the
        second the tokens the first keeps (tight bound), or every token where the first kept too many."""
        (xu1, s1, err1), (xu2, s2, err2) = int8_levels(x)
        approx = cpu_skinny_gemm.kernel_linear_u8s8(xu1, s1, self.q, self.qsum, self.scale)  # (M, N)
        if approx is None:
            return None
        loose = _within_bound(approx, xn, err1, self.coef, self.qnorm, rounding)
        if len(loose) > len(self.q) // 8:  # uncertain rows: a second full pass is cheaper than gathering
            approx.add_(cpu_skinny_gemm.kernel_linear_u8s8(xu2, s2, self.q, self.qsum, self.scale))
            return _within_bound(approx, xn, err2, self.coef, self.qnorm, rounding)
        q, qsum, scale = self.q.index_select(0, loose), self.qsum[loose], self.scale[loose]
        approx = approx[:, loose].add_(cpu_skinny_gemm.kernel_linear_u8s8(xu2, s2, q, qsum, scale))  # (M, C)
        return loose[_within_bound(approx, xn, err2, self.coef[loose], self.qnorm[loose], rounding)]

    def top1_logits(self, x: torch.Tensor) -> torch.Tensor | None:
        """Logits `(..., N)` in the weight's dtype, exact at the candidates (the values the full head gives on
        hf-spec's kernel), -inf elsewhere; None where screening does not apply (x not in the weight's dtype, float32
        or bfloat16, or too many rows)."""
        x2 = x.reshape(-1, x.shape[-1])
        if x.dtype != self.weight.dtype or not 1 <= x2.shape[0] <= max_screened_rows(self.q.numel(), x.dtype):
            return None
        x2 = x2.contiguous()
        if not bool(torch.isfinite(x2).all()):  # the bound needs finite inputs: the full head decides
            return None
        # bfloat16 logits are fp32 sums rounded to 8 significant bits: keep what may round to the top value
        rounding = BF16_ROUNDING if x.dtype == torch.bfloat16 else 0.0
        idx = self.candidates(x2.float(), rounding)
        if idx is None:
            return None
        rows = self.weight.index_select(0, idx)
        exact = (
            cpu_skinny_gemm.kernel_linear_bf16(x2, rows) if x.dtype == torch.bfloat16 else None
        )  # the bf16 kernel's values whatever path the full head would take
        exact = skinny_linear(x2, rows) if exact is None else exact  # (M, C)
        out = torch.full((x2.shape[0], self.weight.shape[0]), float("-inf"), dtype=x.dtype)
        out[:, idx] = exact
        return out.view(*x.shape[:-1], -1)


def int8_levels(x: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], ...]:
    """x `(M, K)` fp32 as two int8 levels per row, x = s_1 q_1 + s_2 q_2 + r: `((xu_1, s_1, err_1), (xu_2, s_2,
    err_2))`, xu_l = q_l + 128 as uint8 `(M, K)`, s_l `(M,)`, and err_l `(M,)` the module docstring's factor of
    |s_j q_j| in the bound after level 1 and after both (fp32, rounded up)."""
    s1 = (x.abs().amax(dim=1) / 127).clamp_(min=1e-30)
    q1 = torch.round(x / s1[:, None]).clamp_(-127, 127)
    rest = x - s1[:, None] * q1  # what the first level left (any q_2 keeps the bound: r is measured)
    s2 = (rest.abs().amax(dim=1) / 127).clamp_(min=1e-30)
    q2 = torch.round(rest / s2[:, None]).clamp_(-127, 127)
    l1, l2 = s1.double()[:, None] * q1.double(), s2.double()[:, None] * q2.double()  # exact in float64
    n1, n2 = l1.norm(dim=1), l2.norm(dim=1)
    # a level's product rounds three times (<= 2^-22 |s_l q_l| |s_j q_j|), the sum of the two levels once more
    err1 = ((x.double() - l1).norm(dim=1) + 2.0**-22 * n1) * (1 + 1e-6)
    err2 = ((x.double() - l1 - l2).norm(dim=1) + 2.0**-21 * (n1 + n2)) * (1 + 1e-6)
    return ((q1 + 128).to(torch.uint8), s1, err1.float()), ((q2 + 128).to(torch.uint8), s2, err2.float())


def _within_bound(
    approx: torch.Tensor,
    err_w: torch.Tensor,
    err_q: torch.Tensor,
    coef: torch.Tensor,
    qnorm: torch.Tensor,
    rounding: float = 0.0,
) -> torch.Tensor:
    """Columns j of scores `approx (M, C)`, each within `e_j = err_w c_j + err_q |s_j q_j|` of the truth (`err_w`,
    `err_q` `(M,)`, `coef` c and `qnorm` |s q| `(C,)`), with `a_j + e_j >= max_k (a_k - e_k)` in some row: those
    that may hold a row's argmax. With `rounding` r > 0 the truth is then rounded (to nearest, error <= r of the
    rounded value): a value rounding to the same as the top value t lies within 2 r (1 + 2 r) |t| of t, so the floor
    is lowered to `f - 4 r |f| - 1e-30` (t - 4 r |t| grows with t, and t >= f)."""
    best, arg = approx.max(dim=1)
    floor = best - err_w * coef[arg] - err_q * qnorm[arg]  # <= max_k (a_k - e_k)
    if rounding:
        floor = floor - 4 * rounding * floor.abs() - 1e-30  # 1e-30: products the kernel flushes to zero
    keep = cpu_skinny_gemm.kernel_select_within(approx, floor, err_w, err_q, coef, qnorm)
    if keep is None:
        err = err_w[:, None] * coef[None] + err_q[:, None] * qnorm[None]
        keep = (approx + err >= floor[:, None]).any(dim=0)
    return keep.nonzero().flatten()


def max_screened_rows(weights: int | None = None, dtype: torch.dtype = torch.float32) -> int:
    """Most rows of x the screen of a head with `weights` weights (None: a large one) takes on this CPU
    (`MAX_ROWS_VNNI` where x is quantized, else `MAX_ROWS`; in bfloat16 at most what the bf16 kernel takes, and
    `BF16_SCREEN_ROWS` where it does not run the full head on 13 rows)."""
    rows = MAX_ROWS_VNNI if int8_x_applies(weights) else MAX_ROWS
    if dtype != torch.bfloat16:
        return rows
    return min(rows, BF16_MAX_ROWS if bf16_kernel_rows() >= 13 else BF16_SCREEN_ROWS)


def int8_x_applies(weights: int | None = None) -> bool:
    """Whether x is quantized too: AVX512-VNNI and a head of at least `INT8_X_MIN_WEIGHTS` weights (None: assume
    so), unless `HF_SPEC_SCREEN_INT8_X=0` (read on every call)."""
    large = weights is None or weights >= INT8_X_MIN_WEIGHTS
    return envs.HF_SPEC_SCREEN_INT8_X and large and cpu_skinny_gemm.has_vnni()


_screens: weakref.WeakKeyDictionary[nn.Module, Int8Screen] = weakref.WeakKeyDictionary()


def _version(weight: torch.Tensor) -> tuple[int, int]:
    return weight.data_ptr(), weight._version


def screen_for(head: nn.Linear) -> Int8Screen:
    """The module's int8 screen, built on first use (one pass over the weight) and when its weight changed."""
    screen = _screens.get(head)
    if screen is None or screen.version != _version(head.weight):
        screen = _screens[head] = Int8Screen.from_weight(head.weight.detach())
    return screen


def screening_disabled() -> bool:
    """`HF_SPEC_SCREENED_HEAD=0` turns screening off (read on every call)."""
    return not envs.HF_SPEC_SCREENED_HEAD


def screening_applies(model: nn.Module, do_sample: bool, has_processors: bool, returns_scores: bool) -> bool:
    """Whether only the verification rows' argmax is ever read, and the model's head can be screened here.
    (Stopping criteria see scores only where they are returned, as in plain decoding.)"""
    if do_sample or has_processors or returns_scores or screening_disabled():
        return False
    head = model.get_output_embeddings()
    if type(head) is not nn.Linear or head.bias is not None:
        return False
    w = head.weight
    if not w.is_cpu or w.dim() != 2 or cpu_skinny_gemm.load_kernel() is None:
        return False
    # bfloat16: where hf-spec's bf16 kernel (AVX512-BF16) rescores the candidates
    return w.dtype == torch.float32 or (w.dtype == torch.bfloat16 and cpu_skinny_gemm.has_bf16())


def _screened_forward(self: nn.Linear, x: torch.Tensor, owner: int = 0) -> torch.Tensor:
    # a compiled graph gets the full head: the screen's candidates are a data-dependent number of rows
    if not torch.compiler.is_compiling() and threading.get_ident() == owner and not torch.is_grad_enabled():
        out = screen_for(self).top1_logits(x)
        if out is not None:
            return out
    return skinny_linear(x, self.weight, self.bias)


@contextlib.contextmanager
def screened_lm_head(model: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Inside the block the model's LM head returns `Int8Screen.top1_logits` for 1..`max_screened_rows()` rows
    (caller checked `screening_applies`); other row counts, and calls from other threads (an asynchronous
    drafter's), and forwards traced by `torch.compile`, get the full head (by `skinny_linear`)."""
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
