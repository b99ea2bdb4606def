"""Saving a head as a folder shaped like a Hub model repo:

config.json          with `auto_map`, so AutoModel.from_pretrained(folder, trust_remote_code=True) loads it
model.safetensors    bf16 weights (the target's embedding / norm / LM head are never stored)
configuration_hf_spec.py, modeling_hf_spec.py   thin re-exports of hf_spec's classes (need `pip install hf-spec`)
custom_generate/generate.py   target.generate(..., custom_generate=folder, trust_remote_code=True)
README.md            model card
hf_spec_config.json  the decoding recipe (method + this head)
hf_spec_checksums.json   sha256 of every other file, written last and checked at load (`hf_spec.io.integrity`)

The folder is written into a temporary sibling and renamed into place (`hf_spec.io.output_folder.staged_folder`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from hf_spec.core.config import MethodConfig
from hf_spec.io.integrity import write_checksums
from hf_spec.io.output_folder import check_output_folder, holds_model_type, staged_folder

_REEXPORT = '''"""Re-exports hf-spec's {kind} classes for `trust_remote_code` loading. Requires `pip install hf-spec`."""

from {module} import {names}  # noqa: F401
'''

_GENERATE_PY = '''"""hf-spec decoding with the draft head of this folder, loaded by
`target.generate(..., custom_generate=<this folder>, trust_remote_code=True)`. Requires `pip install hf-spec`."""

from hf_spec.integrations import generate_with_recipe

RECIPE = {recipe}


def generate(model, **kwargs):
    return generate_with_recipe(model, RECIPE, **kwargs)
'''


# custom_generate/requirements.txt, checked by transformers before it runs the folder's generate.py; on a CUDA
# target hf-spec runs the round's Triton kernels (its `triton` backend), on the CPU its CPU kernels
REQUIREMENTS = """hf-spec>=0.1.0
# hf-spec is not on PyPI: install it with pip install "hf-spec @ git+https://github.com/hf-spec/hf-spec" or from a
# wheel built from its repository (python -m build; see its docs, Getting started > Install)
# GPU: the triton package (it comes with torch's CUDA wheels; else pip install 'hf-spec[triton]') lets hf-spec
# run acceptance, cache compaction, tree masks and draft top-k in its Triton kernels on a CUDA target
"""


def save_head_folder(
    head,
    folder: str | os.PathLike,
    recipe: MethodConfig,
    card: str,
    extra_files: dict[str, str] | None = None,
) -> Path:
    """Write `head` (a `DraftHeadModel`) and everything around it to `folder`, whole or not at all; `extra_files`
    (relative path -> text, e.g. a training report) are written into it too and listed in its checksums."""
    folder = Path(folder)
    check_output_folder(folder, holds_model_type(head.config.model_type), f"{head.config.model_type} head")
    with staged_folder(folder) as new:
        write_head_files(head, new, recipe, card)
        for relative, text in (extra_files or {}).items():
            (new / relative).write_text(text)
        write_checksums(new)  # last
    return folder


def write_head_files(head, folder: Path, recipe: MethodConfig, card: str) -> None:
    """Every file of a head folder but its checksum list, into `folder` (a `staged_folder`)."""
    config_cls, model_cls = type(head.config), type(head)
    head.config.auto_map = {
        "AutoConfig": f"configuration_hf_spec.{config_cls.__name__}",
        "AutoModel": f"modeling_hf_spec.{model_cls.__name__}",
    }
    head.config.architectures = [model_cls.__name__]
    bf16 = type(head)(head.config)
    bf16.load_state_dict(head.state_dict())
    # a class once loaded through trust_remote_code is marked for auto-class export, and save_pretrained would then
    # copy hf_spec's source files into the folder; the thin re-exports below are what the folder should hold
    saved_marks = {
        cls: cls.__dict__["_auto_class"] for cls in (config_cls, model_cls) if "_auto_class" in cls.__dict__
    }
    for cls in (config_cls, model_cls):
        cls._auto_class = None
    try:
        bf16.to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
    finally:
        for cls in (config_cls, model_cls):
            del cls._auto_class
        for cls, mark in saved_marks.items():
            cls._auto_class = mark
    (folder / "configuration_hf_spec.py").write_text(
        _REEXPORT.format(kind="config", module=config_cls.__module__, names=config_cls.__name__)
    )
    (folder / "modeling_hf_spec.py").write_text(
        _REEXPORT.format(
            kind="model", module=model_cls.__module__, names=f"{config_cls.__name__}, {model_cls.__name__}"
        )
    )
    write_recipe_and_card(folder, recipe, card)


def write_recipe_and_card(folder: str | os.PathLike, recipe: MethodConfig, card: str) -> None:
    """Write the decoding recipe (`hf_spec_config.json`), `custom_generate/` and the model card (`README.md`) into a
    head folder (a `staged_folder`); the caller writes the checksum list after them."""
    folder = Path(folder)
    recipe.save_pretrained(folder)
    for relative, text in recipe_and_card_files(recipe, card, with_config=False).items():
        (folder / relative).parent.mkdir(parents=True, exist_ok=True)
        (folder / relative).write_text(text)


def recipe_and_card_files(recipe: MethodConfig, card: str, with_config: bool = True) -> dict[str, str]:
    """The recipe (`hf_spec_config.json`, unless not `with_config`), `custom_generate/` and model card files of a
    head folder: relative path -> text."""
    files = {"hf_spec_config.json": json.dumps(recipe.resolved().to_dict(), indent=2) + "\n"}
    return (files if with_config else {}) | {
        "custom_generate/generate.py": _GENERATE_PY.format(recipe=repr(json.dumps(recipe.to_dict()))),
        "custom_generate/requirements.txt": REQUIREMENTS,
        "README.md": card,
    }
