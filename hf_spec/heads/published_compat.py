"""What can be checked of a published head against the target it is loaded onto.

A published checkpoint carries no hf-spec fingerprint, so only its shapes and declared fields can be compared:
hidden size, vocabulary size, the target family its config names, and (EAGLE-3) the target layers it reads. A head
trained for another fine-tune of the same base model passes these checks: it stays lossless, it only drafts worse.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedModel

# the architecture of the EAGLE heads themselves: a config naming it says nothing about the target's family
HEAD_FAMILIES = ("llama",)


def target_vocab_sizes(target: PreTrainedModel) -> set[int]:
    """The vocabulary sizes a head may declare for `target`: its config's and its LM head's rows."""
    sizes = {int(target.get_output_embeddings().weight.shape[0])}
    if getattr(target.config, "vocab_size", None):
        sizes.add(int(target.config.vocab_size))
    return sizes


def check_fits_target(
    what: str,
    target: PreTrainedModel,
    hidden_size: int,
    vocab_size: int | None = None,
    model_type: str | None = None,
    layer_ids: Sequence[int] = (),
    target_hidden_size: int | None = None,
) -> None:
    """Raise `ValueError` naming the first mismatch between a head and `target`.

    Args:
        what: the head, as errors name it (`"the eagle head 'org/name'"`).
        hidden_size: the width of the target states the head reads (`target_hidden_size` when they differ from
            the head's own width, as EAGLE-3 heads may).
        vocab_size: the target vocabulary the head was made for (None: not declared).
        model_type: the family its config names; `"llama"` (the heads' own architecture) is not compared.
        layer_ids: target layers whose outputs the head reads (EAGLE-3): each must exist in `target`.
    """
    config = target.config
    have_hidden = int(config.hidden_size)
    want_hidden = target_hidden_size or hidden_size
    if want_hidden != have_hidden:
        raise ValueError(
            f"{what} reads hidden states of size {want_hidden}, but the target's hidden size is {have_hidden}: "
            "it was made for another model"
        )
    sizes = target_vocab_sizes(target)
    if vocab_size is not None and int(vocab_size) not in sizes:
        raise ValueError(
            f"{what} was made for a vocabulary of {vocab_size} tokens, but the target's vocab size is "
            f"{max(sizes)}: it was made for another model (or tokenizer)"
        )
    if model_type and model_type not in HEAD_FAMILIES and model_type != config.model_type:
        raise ValueError(
            f"{what} names a {model_type!r} target in its config, but the target is a {config.model_type!r} model"
        )
    layers = int(config.num_hidden_layers)
    bad = [i for i in layer_ids if not -layers <= int(i) < layers + 1]
    if bad:
        raise ValueError(f"{what} reads target layers {bad}, but the target has {layers} layers")
