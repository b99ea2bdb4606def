"""Opt-in integration with `model.generate(assistant_model=...)` and Hub-style `custom_generate` folders.

Nothing here runs on import: `enable_assistant(model)` patches that one model instance (not its class)
and `AssistantHandle.disable()` (or leaving the `with` block) restores it.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Literal

import torch
from transformers import PreTrainedModel
from transformers.generation.candidate_generator import CandidateGenerator

from hf_spec.core.compat import generate_frame_local, passed_cache
from hf_spec.core.config import CONFIG_NAME, MethodConfig
from hf_spec.core.drafter import Drafter, RoundResult, SpecState
from hf_spec.core.specs import HEAD_IN_THIS_FOLDER
from hf_spec.decoder import SpeculativeDecoder
from hf_spec.engine.round import propose_within_room
from hf_spec.engine.target.hidden import select_hidden_states
from hf_spec.engine.target.profile import target_profile
from hf_spec.heads.hub import REQUIREMENTS
from hf_spec.io.integrity import CHECKSUM_FILE, verify_checksums, write_checksums
from hf_spec.io.output_folder import check_output_folder, settle_folder, staged_folder
from hf_spec.tree import DraftTree

AssistantLike = SpeculativeDecoder | Drafter | MethodConfig


def _as_decoder(assistant: AssistantLike) -> SpeculativeDecoder:
    return assistant if isinstance(assistant, SpeculativeDecoder) else SpeculativeDecoder(assistant)


class HfSpecCandidateGenerator(CandidateGenerator):
    """Runs an hf-spec drafter inside transformers' own assisted loop (`_assisted_decoding`).

    The round engine's propose and observe steps run here; the forward, acceptance and commit are transformers'.
    That loop verifies one chain, so a tree is cut to its first branch (each node's first child). Proposals
    without `draft_probs` go out with `candidate_logits=None`, which transformers treats as deterministic.
    Drafters that need the target's hidden states (EAGLE heads) get them through the loop's
    `requires_model_outputs` / `model_kwargs_overrides` hooks: the first iteration proposes nothing so the target
    prefills the prompt, and each round's hidden states reach the drafter at the next `get_candidates`.
    """

    requires_model_outputs = True

    def __init__(self, drafter: Drafter, model: PreTrainedModel, generation_config) -> None:
        self.drafter = drafter
        self.model = model
        self.generation_config = generation_config
        self.wants_hidden = drafter.requires_hidden_states
        self.model_kwargs_overrides: dict = {"output_hidden_states": True} if self.wants_hidden else {}
        self.state: SpecState | None = None
        self.chain = DraftTree.empty()
        self.last_round: tuple[int, list[int]] | None = (
            None  # (num_matches, new tokens) awaiting hidden states
        )

    def get_candidates(
        self, input_ids: torch.LongTensor, **kwargs
    ) -> tuple[torch.LongTensor, torch.Tensor | None]:
        cache = passed_cache(kwargs["model_kwargs"])
        outputs = kwargs.get("model_outputs")
        if self.wants_hidden and kwargs.get("is_first_iteration", self.state is None):
            return input_ids, None  # let the target prefill the prompt: its hidden states come back next call
        if self.state is None:
            layers = self.drafter.hidden_state_layers
            hidden = select_hidden_states(outputs.hidden_states, layers) if self.wants_hidden else None
            self.state = SpecState(
                self.model,
                cache,
                input_ids,
                self.generation_config,
                hidden,
                uses_verify_forward=False,
                backend=target_profile(self.model).backend,
            )
            self.drafter.begin(self.state)
        elif self.last_round is not None:
            num_matches, new_tokens = self.last_round
            hidden = None
            if self.wants_hidden:
                layers = self.drafter.hidden_state_layers
                hidden = select_hidden_states(outputs.hidden_states, layers)[:, : num_matches + 1]
            self.state.hidden_states = hidden
            self.drafter.observe(
                self.state, RoundResult(self.chain, list(range(num_matches)), new_tokens, hidden)
            )
        self.last_round = None
        self.state.input_ids, self.state.cache = input_ids, cache
        with self.state.backend.drafting(self.model):
            self.chain = _first_branch(propose_within_room(self.drafter, self.state))
        candidates = torch.cat([input_ids, self.chain.tokens.view(1, -1).to(input_ids.device)], dim=1)
        logits = None
        if self.chain.draft_probs is not None and bool(self.chain.draft_probs.any(dim=-1).all()):
            logits = self.chain.draft_probs.log()[None]  # softmax(log q) == q
        return candidates, logits

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int):
        if self.state is None:  # the prefill round of a hidden-state drafter
            return
        new = input_ids.shape[1] - self.state.input_ids.shape[1]
        new_tokens = input_ids[0, -new:].tolist()
        self.state.input_ids = input_ids
        if self.wants_hidden:  # observed at the next get_candidates, with this round's hidden states
            self.last_round = (num_matches, new_tokens)
        else:
            self.drafter.observe(self.state, RoundResult(self.chain, list(range(num_matches)), new_tokens))


def _first_branch(tree: DraftTree) -> DraftTree:
    keep = torch.zeros(len(tree), dtype=torch.bool)
    node = -1
    while tree.children[node + 1]:
        node = tree.children[node + 1][0]
        keep[node] = True
    return tree.select(keep)


class AssistantHandle:
    """Returned by `enable_assistant`; a context manager. `disable()` restores the model's own `generate`."""

    def __init__(self, model: PreTrainedModel, loop: str) -> None:
        self.model, self.loop = model, loop

    def disable(self) -> None:
        self.model.__dict__.pop("generate", None)
        self.model.__dict__.pop("_get_candidate_generator", None)

    def __enter__(self) -> AssistantHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.disable()


def enable_assistant(
    model: PreTrainedModel, loop: Literal["hf-spec", "transformers"] = "hf-spec"
) -> AssistantHandle:
    """Let `model.generate(..., assistant_model=X)` accept hf-spec drafters.

    `X` may be a `SpeculativeDecoder`, a `Drafter` or a `MethodConfig`; any other assistant (a transformers
    model) goes to transformers untouched.
    - `loop="hf-spec"`: hf-spec's tree loop runs (same as `custom_generate=SpeculativeDecoder(X)`).
    - `loop="transformers"`: transformers' own assisted loop runs, with the drafter's first branch as the
      candidate chain.
    """
    if loop not in ("hf-spec", "transformers"):
        raise ValueError(f"loop must be 'hf-spec' or 'transformers', got {loop!r}")
    if "generate" in model.__dict__:
        raise RuntimeError("hf-spec assistant support is already enabled on this model")
    original = type(model).generate
    drafting = threading.local()  # the drafter of this thread's call (calls on other threads have their own)

    def candidate_generator(*args, **kwargs):
        drafter = getattr(drafting, "drafter", None)
        if drafter is None:  # not a call of ours: transformers' own choice
            return type(model)._get_candidate_generator(model, *args, **kwargs)
        generation_config = kwargs["generation_config"] if "generation_config" in kwargs else args[0]
        return HfSpecCandidateGenerator(drafter, model, generation_config)

    def generate(*args, assistant_model=None, **kwargs):
        if not isinstance(assistant_model, AssistantLike):
            return original(model, *args, assistant_model=assistant_model, **kwargs)
        decoder = _as_decoder(assistant_model)
        if loop == "hf-spec":
            return original(model, *args, custom_generate=decoder, **kwargs)
        with decoder.lend(model) as (drafting.drafter,):
            try:  # the target stands in as "assistant" for transformers' checks; our generator does the drafting
                return original(model, *args, assistant_model=model, **kwargs)
            finally:
                drafting.drafter = None

    model.generate = generate
    if loop == "transformers":
        model._get_candidate_generator = candidate_generator
    return AssistantHandle(model, loop)


_GENERATE_PY = '''"""hf-spec speculative decoding recipe, loaded by `model.generate(custom_generate=<this folder>,
trust_remote_code=True)`. Requires the `hf-spec` package."""

from hf_spec.integrations import generate_with_recipe

RECIPE = {recipe}


def generate(model, **kwargs):
    return generate_with_recipe(model, RECIPE, **kwargs)
'''


def save_custom_generate(folder: str | Path, method: str | MethodConfig, overwrite: bool = False) -> Path:
    """Write a Hub-style folder whose `custom_generate/generate.py` runs `method` through hf-spec's loop.

    `folder` must be new, empty or an earlier recipe folder; one that holds another artefact (a head, a datastore,
    a model, other files) is refused unless `overwrite=True`, which replaces only the recipe's files (and renews
    the checksum list of a folder that has one, after checking it). The folder is written whole or not at all: into
    a temporary sibling renamed into place."""
    from hf_spec.core.specs import parse_method

    config = parse_method(method)
    folder = Path(folder)
    settle_folder(folder)
    if not overwrite:
        check_output_folder(
            folder,
            _is_recipe_folder,
            "custom_generate recipe",
            "choose another folder, or pass overwrite=True",
        )
    listed = (folder / CHECKSUM_FILE).is_file()
    if listed:  # its other files are carried over and listed again: only if they are intact
        verify_checksums(folder, f"the folder {folder}")
    recipe = json.dumps(config.resolved().to_dict())
    # relative paths of a recipe read from this very folder stay relative (as `save_pretrained` keeps them)
    keep = config.source is not None and config.source.parent.resolve() == folder.resolve()
    saved = json.dumps((config if keep else config.resolved()).to_dict(), indent=2) + "\n"
    with staged_folder(folder, carry=_not_recipe_file) as new:
        (new / CONFIG_NAME).write_text(saved)
        (new / "custom_generate").mkdir(exist_ok=True)
        (new / "custom_generate" / "generate.py").write_text(_GENERATE_PY.format(recipe=repr(recipe)))
        (new / "custom_generate" / "requirements.txt").write_text(REQUIREMENTS)
        if listed:
            write_checksums(new)  # last
    return folder


def _not_recipe_file(path: Path) -> bool:
    """A file of an earlier folder that a new recipe keeps: all but its recipe, `custom_generate/` and checksums."""
    return path.parts[0] not in ("hf_spec_config.json", "custom_generate", CHECKSUM_FILE)


def _is_recipe_folder(folder: Path) -> bool:
    """An earlier `save_custom_generate` output: its recipe, `custom_generate/` and nothing else."""
    return {p.name for p in folder.iterdir()} <= {"hf_spec_config.json", "custom_generate"}


def generate_with_recipe(model: PreTrainedModel, recipe: str | dict, **generate_kwargs):
    """Entry used by saved `custom_generate/generate.py` files: re-enter `generate` with the hf-spec loop.

    The recipe is read as `SpeculativeDecoder(folder)` reads it: from the `hf_spec_config.json` of the local folder
    passed as `custom_generate=` (so an edit of that file is what runs, and a head path in it that does not resolve
    is an error); `recipe`, the copy written into `generate.py`, serves a folder given as a Hub id."""
    from hf_spec.core.registry import get_method
    from hf_spec.core.specs import parse_method

    folder = generate_frame_local("custom_generate")
    local = isinstance(folder, (str, os.PathLike)) and (Path(folder) / CONFIG_NAME).is_file()
    if local:
        config = parse_method(str(folder))
        key = json.dumps([str(Path(folder).resolve()), (Path(folder) / CONFIG_NAME).stat().st_mtime_ns])
    else:
        data = json.loads(recipe) if isinstance(recipe, str) else dict(recipe)
        if (
            data.get("head") == HEAD_IN_THIS_FOLDER
        ):  # a head repo's own recipe: the head is the folder being run
            if not isinstance(folder, (str, os.PathLike)):
                raise ValueError(
                    "this recipe uses the head of the folder passed as custom_generate=; pass the folder path"
                )
            data["head"] = str(folder)
        config = get_method(data["method"]).config_cls.from_dict(data)
        key = json.dumps(data, sort_keys=True)
    with _RECIPE_LOCK:  # the head is loaded once, not at every call (nor by two threads at once)
        if key not in _RECIPE_DECODERS:
            _RECIPE_DECODERS[key] = SpeculativeDecoder(config)
        decoder = _RECIPE_DECODERS[key]
    generate_kwargs = {k: v for k, v in generate_kwargs.items() if v is not None}
    return model.generate(custom_generate=decoder, **generate_kwargs)


_RECIPE_DECODERS: dict[str, SpeculativeDecoder] = {}
_RECIPE_LOCK = threading.Lock()
