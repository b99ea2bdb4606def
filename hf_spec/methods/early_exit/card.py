"""The model card (README.md) of a saved exit-heads folder (`hf_spec.heads.card.exit_heads_card` writes it)."""

from __future__ import annotations

from hf_spec.heads.card import exit_heads_card
from hf_spec.methods.early_exit.exit_heads import ExitHeads


def model_card(heads: ExitHeads, command: str) -> str:
    """README.md of a saved exit-heads folder."""
    return exit_heads_card(heads.config.to_dict(), command)
