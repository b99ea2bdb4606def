"""The target hidden states a drafter asked for (`Drafter.hidden_state_layers`), taken from a forward's
`output_hidden_states` tuple: the last layer's (the default), or several layers joined (EAGLE-3's low, mid and
high states)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def select_hidden_states(hidden_states: Sequence[torch.Tensor], layers: Sequence[int]) -> torch.Tensor:
    """The states at `layers` (indices into `hidden_states`), joined along the last dimension.

    Args:
        hidden_states: a forward's `output_hidden_states`, each `(batch, seq, hidden_size)`.
        layers: indices into it, e.g. `(-1,)` or `(2, 16, 29)`.

    Returns:
        `(batch, seq, len(layers) * hidden_size)`.
    """
    if tuple(layers) == (-1,):
        return hidden_states[-1]
    if max(layers) >= len(hidden_states) or min(layers) < -len(hidden_states):
        raise ValueError(
            f"the drafter reads the target's hidden states {list(layers)}, but this forward returned "
            f"{len(hidden_states)} of them (a verification forward that keeps only the last layer's cannot feed it)"
        )
    return torch.cat([hidden_states[i] for i in layers], dim=-1)


__all__ = ["select_hidden_states"]
