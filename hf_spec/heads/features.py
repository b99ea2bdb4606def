"""The target features a draft head reads: the target's last-layer state before its final norm, at unit RMS.

Both sides use it: inference (`methods/head_drafter.py` feeds a head the features of committed positions) and
training (`training/features.py` stores them per position), so it lives here, away from training code.
"""

from __future__ import annotations

import torch


def unit_features(post_norm_hidden: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    """Unit-RMS states `(..., hidden_size)` from the final norm's outputs `(..., hidden_size)`.

    `y = norm(z) = z / rms(z) * w`, so `z / rms(z) = y / w`: the state the target's own final norm maps to `y`. A
    head that predicts it can reuse the target's norm and LM head to get exactly the target's logits.
    """
    return post_norm_hidden.float() / norm.weight.float()


__all__ = ["unit_features"]
