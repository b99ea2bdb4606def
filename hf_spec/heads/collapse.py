"""Telling a collapsed head from a working one by its training report: a collapsed head gets no publishable card."""

from __future__ import annotations

from typing import Any

# A head collapses when its agreement at draft depth 2 is under a quarter of its depth-1 agreement (it no longer
# follows its own drafts), its depth-1 agreement is under 5% (it predicts almost nothing), or its held-out loss is
# over 4x its final training loss (it learned its training data, not the target). Card generation refuses such a
# head a publishable card: a trainer still saves what it trained, under a card that says so at its top
# (`allow_collapsed`), and `scripts/update_head_card.py` / `canonical.py report` (the committed cards) refuse it.
COLLAPSE_DEPTH_RATIO = 0.25
COLLAPSE_MIN_AGREEMENT = 0.05
COLLAPSE_LOSS_RATIO = 4.0


class CollapsedHeadError(ValueError):
    """A head's held-out agreement collapsed (see `collapse_reason`): it gets no publishable card."""


def collapse_reason(report: dict[str, Any]) -> str | None:
    """Why the held-out figures of a training report show a collapsed head, or None (also when it has no held-out
    figures to judge by).

    Example: agreement by depth `[0.372, 0.011, 0.006, 0.008]` collapses (0.011 < 0.25 x 0.372);
    `[0.356, 0.157, 0.096, 0.078]` does not.
    """
    heldout = report.get("heldout") or {}
    by_depth = heldout.get("accuracy_by_depth") or []
    if by_depth and by_depth[0] < COLLAPSE_MIN_AGREEMENT:
        return f"held-out agreement at depth 1 is {by_depth[0]:.3f}, under {COLLAPSE_MIN_AGREEMENT}"
    if len(by_depth) > 1 and by_depth[1] < COLLAPSE_DEPTH_RATIO * by_depth[0]:
        return (
            f"held-out agreement falls from {by_depth[0]:.3f} at depth 1 to {by_depth[1]:.3f} at depth 2, under "
            f"{COLLAPSE_DEPTH_RATIO} of it: the head does not follow its own drafts"
        )
    loss, final = heldout.get("loss"), report.get("final_loss")
    if isinstance(loss, (int, float)) and isinstance(final, (int, float)) and final > 0:
        if loss > COLLAPSE_LOSS_RATIO * final:
            return f"held-out loss {loss:.2f} is over {COLLAPSE_LOSS_RATIO:g}x the final training loss {final:.2f}"
    return None


def check_not_collapsed(report: dict[str, Any], what: str = "the head") -> None:
    """Raise `CollapsedHeadError` when `collapse_reason(report)` finds the head collapsed."""
    reason = collapse_reason(report)
    if reason:
        raise CollapsedHeadError(
            f"{what} collapsed on its held-out data ({reason}): it gets no card to publish it with. Train it with "
            "context alignment (--align-steps 3 --topk 10), on more data, or for fewer epochs"
        )


def collapse_banner(report: dict[str, Any]) -> list[str]:
    """The warning at the top of the card of a collapsed head a trainer saved."""
    reason = collapse_reason(report)
    if not reason:
        return []
    return [
        f"> **Collapsed head: not for publishing.** {reason[0].upper()}{reason[1:]}. It drafts badly; train it with "
        "context alignment (`--align-steps 3 --topk 10`), on more data, or for fewer epochs.",
        "",
    ]


__all__ = ["CollapsedHeadError", "check_not_collapsed", "collapse_banner", "collapse_reason"]
