"""Method configs: every committed config still loads as written, typed fields refuse bad values by name, saved
configs carry `config_version`, and the library's layering (inference never imports training; no default names a
machine path)."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import hf_spec.core.config
from hf_spec.core.config import CONFIG_VERSION, ConfigPart, MethodConfig, config_schema
from hf_spec.core.config_paths import resolve_spec
from hf_spec.core.registry import get_method, list_methods
from hf_spec.core.specs import parse_method
from hf_spec.kernels.weight_only import SCHEMES
from hf_spec.methods.early_exit.config import EarlyExitConfig
from hf_spec.methods.lyanna.config import LyannaConfig
from hf_spec.methods.postuse.config import PostUseConfig
from hf_spec.methods.retrieval.config import RetrievalConfig
from hf_spec.methods.talon.config import TalonConfig, TalonSwitch

REPO = Path(__file__).resolve().parents[1]
CONFIG_FILES = sorted(
    [
        *(REPO / "benchmarks" / "configs").glob("*.json"),
        *(REPO / "model_cards").glob("*/hf_spec_config.json"),
    ]
)
RECIPE_FILES = sorted((REPO / "model_cards").glob("*/custom_generate/generate.py"))


def _method_config_files() -> list[Path]:
    """Committed configs that are method configs (Pre-cut Q-tables sit beside them: `"format": ...`)."""
    return [p for p in CONFIG_FILES if "method" in json.loads(p.read_text())]


def _recipe(path: Path) -> dict:
    """The `RECIPE` JSON string of a saved `custom_generate/generate.py`."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "RECIPE":
            return json.loads(ast.literal_eval(node.value))
    raise AssertionError(f"{path} has no RECIPE")


def _as_loaded(value):
    """A config file's value as the loaded config holds it: `""` means None (off) in files without a version."""
    if value == "":
        return None
    if isinstance(value, dict):
        return {k: _as_loaded(v) for k, v in value.items()}
    return value


def _assert_loads_as_written(data: dict, config: MethodConfig) -> None:
    """Every key of a version-1 file is the loaded config's value (nested configs compared key by key); keys of
    options removed since hold the value that behaves as today's code."""
    saved = config.to_dict()
    for key, value in data.items():
        if key in ("method", "config_version"):  # a file's version: the saved config carries today's
            continue
        if key in type(config).removed_fields:
            assert value == type(config).removed_fields[key], key
            continue
        got = saved[key]
        if isinstance(value, dict) and isinstance(getattr(config, key), MethodConfig):
            _assert_loads_as_written(value, getattr(config, key))
        else:
            assert got == _as_loaded(value), (key, value, got)


def test_there_are_committed_configs_to_check():
    assert len(_method_config_files()) >= 20 and len(RECIPE_FILES) >= 6


@pytest.mark.parametrize("path", _method_config_files(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_committed_config_loads_as_written(path, monkeypatch):
    monkeypatch.chdir(REPO)
    data = json.loads(path.read_text())
    config = parse_method(str(path))
    assert config.method == data["method"]
    _assert_loads_as_written(data, config)
    for nested in ("drafter",):  # method specs of wrapped drafters resolve too (from the config's folder)
        spec = getattr(config, nested, None)
        if isinstance(spec, str):
            spec = resolve_spec(spec, config.source, nested)
            assert parse_method(spec).method != config.method
    again = get_method(config.method).config_cls.from_dict(json.loads(json.dumps(config.to_dict())))
    assert again == config


@pytest.mark.parametrize("path", RECIPE_FILES, ids=lambda p: p.parents[1].name)
def test_every_committed_custom_generate_recipe_loads(path):
    data = _recipe(path)
    config = get_method(data["method"]).config_cls.from_dict(data)
    _assert_loads_as_written(data, config)


def test_saved_configs_carry_their_version_and_load_back(tmp_path):
    config = TalonConfig(
        retrieval={"max_nodes": 8, "prompt_lookup": 3}, drafter="early-exit:2", fusion={"both_nodes": 4}
    )
    assert isinstance(config.retrieval, RetrievalConfig) and config.retrieval.max_nodes == 8
    saved = json.loads((config.save_pretrained(tmp_path / "talon") / "hf_spec_config.json").read_text())
    assert saved["config_version"] == CONFIG_VERSION
    assert (
        saved["retrieval"]["max_nodes"] == 8 and "config_version" not in saved["retrieval"]
    )  # nested: a dict
    assert parse_method(str(tmp_path / "talon")) == config
    nested = PostUseConfig(drafter={"method": "early-exit", "exit_layer": 1, "quantize": "int8"})
    assert isinstance(nested.drafter, EarlyExitConfig) and nested.drafter.quantize == "int8"
    assert nested.to_dict()["drafter"] == {"method": "early-exit", **dataclasses.asdict(nested.drafter)}
    assert PostUseConfig.from_dict(json.loads(json.dumps(nested.to_dict()))) == nested


def test_version_one_files_keep_loading_and_removed_options_are_named():
    old = {"method": "talon", "drafter": "", "retrieval": {"datastore_path": ""}, "draft_ahead": 0}
    config = TalonConfig.from_dict({**old, "draft_threads": 1})
    assert config.drafter is None and config.retrieval.datastore_path is None
    with pytest.raises(ValueError, match="option 'draft_ahead' was removed"):
        TalonConfig.from_dict({**old, "draft_ahead": 4})
    with pytest.raises(ValueError, match="option 'seed' was removed"):
        PostUseConfig.from_dict({"method": "postuse", "seed": 3})
    with pytest.warns(FutureWarning, match="q_table -> precut.q_table"):  # a version-1 file is flat too
        assert PostUseConfig.from_dict({"keep_cache": True, "q_table": ""}).precut.q_table is None
    with pytest.raises(ValueError, match=r"unknown talon config keys \['draft_ahead'\]"):  # not in version 2
        TalonConfig.from_dict({**old, "config_version": 2})
    with pytest.raises(ValueError, match="config_version 99; this hf-spec reads up to"):
        TalonConfig.from_dict({"config_version": 99})
    with pytest.raises(ValueError, match="config_version must be a positive integer"):
        TalonConfig.from_dict({"config_version": "2"})
    # a nested config in a version-1 file reads as version 1 too
    legacy = {"method": "postuse", "drafter": {"method": "talon", "retrieval": None, "draft_threads": 1}}
    assert PostUseConfig.from_dict(legacy).drafter == TalonConfig(retrieval=None)


def test_choice_fields_list_their_values():
    with pytest.raises(ValueError, match=r"talon.schedule: mode must be 'sync' or 'async', got 'parallel'"):
        TalonConfig(schedule={"mode": "parallel"})
    with pytest.raises(ValueError, match=r"quantize must be 'int8', 'int4' or None, got 'int3'"):
        EarlyExitConfig(quantize="int3")
    with pytest.raises(ValueError, match=r"resample must be 'off', 'separate' or 'fused', got True"):
        LyannaConfig(resample=True)
    with pytest.raises(
        ValueError, match=r"postuse.precut: reward must be 'useful', 'accepted' or 'committed'"
    ):
        PostUseConfig(precut={"reward": "speed"})
    with pytest.raises(
        ValueError, match=r"retrieval must be a settings object or null \(a dict or Retrieval"
    ):
        TalonConfig(retrieval=3)
    with pytest.raises(
        ValueError, match=r"drafter must be a method spec or a settings object \(a dict or Method"
    ):
        PostUseConfig(drafter=3)
    with pytest.raises(ValueError, match="needs a 'method' name"):
        PostUseConfig(drafter={"exit_layer": 2})
    assert EarlyExitConfig(quantize="").quantize is None  # "" is how version 1 said "off"
    assert config_schema(EarlyExitConfig)["quantize"].choices == SCHEMES  # the kernels' schemes, no other


# the layout before Talon and Post-use had parts: the committed recommended configs as they were saved
FLAT_TALON = {
    "method": "talon",
    "retrieval": {
        "num_draft_tokens": 10,
        "max_nodes": 15,
        "long_match": 8,
        "prompt_lookup": 3,
        "auto_nodes": True,
    },
    "drafter": "early-exit:2",
    "mode": "sync",
    "adaptive": True,
    "draft_ahead": 0,
    "draft_threads": 1,
    "verify_threads": 0,
    "async_min_acceptance": 0.0,
    "switch": "match",
    "skip_match": 8,
    "both_nodes": 7,
    "both_lookup": "cut",
}
NESTED_TALON = {
    "method": "talon",
    "config_version": 3,
    "retrieval": FLAT_TALON["retrieval"],
    "drafter": "early-exit:2",
    "switch": {"rule": "match", "skip_match": 8},
    "fusion": {"both_nodes": 7},
}
FLAT_POSTUSE = {
    "method": "postuse",
    "drafter": {"method": "early-exit", "exit_layer": 2},
    "phrase_length": 5,
    "draft_phrases": 2,
    "target_anchors": 3,
    "target_phrases": 3,
    "max_tree_nodes": 0,
    "admit_prompt": True,
    "reuse_draft": True,
    "reuse_target": True,
    "precut": True,
    "max_draft_length": 5,
    "reward": "committed",
    "init_continue": -0.29,
    "init_stop": -0.3,
    "warmup_rounds": 10,
    "freeze": True,
    "auto_tree_tolerance": 1.15,
}
NESTED_POSTUSE = {
    "method": "postuse",
    "config_version": 3,
    "drafter": {"method": "early-exit", "exit_layer": 2},
    "cache": {"phrase_length": 5, "admit_prompt": True},
    "reuse_draft": {"phrases": 2},
    "reuse_target": {"anchors": 3, "phrases": 3, "max_tree_nodes": 0, "auto_tree_tolerance": 1.15},
    "precut": {
        "max_draft_length": 5,
        "reward": "committed",
        "init_continue": -0.29,
        "init_stop": -0.3,
        "warmup_rounds": 10,
        "freeze": True,
    },
}


@pytest.mark.parametrize(("flat", "nested"), [(FLAT_TALON, NESTED_TALON), (FLAT_POSTUSE, NESTED_POSTUSE)])
def test_flat_config_files_load_with_a_warning_and_save_nested(tmp_path, flat, nested):
    """A config file in the flat layout loads as its nested form, with a FutureWarning that says how to re-save it;
    saving writes the parts, which load without a warning."""
    (tmp_path / "old.json").write_text(json.dumps(flat))
    with pytest.warns(FutureWarning, match=r"flat config keys are deprecated.*save_pretrained"):
        old = parse_method(str(tmp_path / "old.json"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new = get_method(nested["method"]).config_cls.from_dict(nested)
        assert old == new
        saved = json.loads((old.save_pretrained(tmp_path / "new") / "hf_spec_config.json").read_text())
        fields = {f.name for f in dataclasses.fields(old)}
        assert saved["config_version"] == CONFIG_VERSION and not set(saved) & (
            set(type(old).flat_keys) - fields
        )
        for part in fields - {"retrieval", "drafter", "draft_length"}:
            assert saved[part] is None or isinstance(saved[part], dict), part
            assert "method" not in (saved[part] or {}), part  # a part is a plain dict
        assert parse_method(str(tmp_path / "new")) == old
        assert parse_method(f"{old.method}:{tmp_path / 'new'}") == old  # the `name:CONFIG` form of the CLI


def test_flat_keyword_arguments_and_switches_map_to_parts():
    with pytest.warns(FutureWarning, match=r"switch -> switch.rule, extend_tokens -> fusion.extend_tokens"):
        config = TalonConfig(switch="best", extend_tokens=3)
    assert config == TalonConfig(switch={"rule": "best"}, fusion={"extend_tokens": 3})
    with pytest.warns(FutureWarning, match="adaptive: false -> switch: null"):
        assert TalonConfig(adaptive=False, mode="async").switch is None
    with pytest.warns(FutureWarning, match="precut: false -> precut: null"):
        off = PostUseConfig.from_dict({"precut": False, "reuse_draft": False, "alpha": 0.5, "pool_size": 9})
    assert off.precut is None and off.reuse_draft is None and off.cache.pool_size == 9
    assert off.reuse_target == PostUseConfig().reuse_target  # not named: its defaults, as before
    with pytest.warns(FutureWarning):  # a flat key beside its part: the part's own value wins
        both = PostUseConfig(alpha=0.5, precut={"alpha": 0.2, "gamma": 1.0})
    assert both.precut.alpha == 0.2 and both.precut.gamma == 1.0
    with pytest.raises(
        AttributeError, match="has no attribute 'both_nodes': the setting is now fusion.both_nodes"
    ):
        TalonConfig().both_nodes  # noqa: B018
    with pytest.raises(
        TypeError, match=r"precut must be a dict of its settings or null \(true or false in the flat layout"
    ):
        PostUseConfig.from_dict({"precut": "yes"})


def test_config_parts_check_their_own_rules_by_name():
    """Each part refuses a bad value naming the part and the field; rules across parts name both."""
    for build, message in [
        (
            lambda: TalonSwitch(rule="cost", skip_match=3),
            "talon.switch: skip_match and skip_lookup apply to rule",
        ),
        (
            lambda: TalonConfig(switch={"explore_every": -2}),
            "talon.switch: explore_every must be >= 0, got -2",
        ),
        (
            lambda: TalonConfig(schedule={"min_acceptance": 0.5}),
            "talon.schedule: .* apply to mode 'async' only",
        ),
        (
            lambda: TalonConfig(fusion={"both_lookup": "whole"}),
            "talon.fusion: both_lookup 'whole' needs both_nodes",
        ),
        (
            lambda: TalonConfig(retrieval=None, fusion={"both_nodes": 2}),
            "talon: fusion.both_nodes needs both",
        ),
        (
            lambda: PostUseConfig(cache={"phrase_length": 1}),
            r"postuse.cache: phrase_length \(beta\) must be >= 2",
        ),
        (
            lambda: PostUseConfig(precut={"max_draft_length": 0}),
            "postuse.precut: max_draft_length must be >= 1",
        ),
        (
            lambda: PostUseConfig(reuse_target={"auto_tree_max": 0}),
            "postuse.reuse_target: auto_tree_max must be",
        ),
        (
            lambda: PostUseConfig(precut={"gamma": 0.9, "beta": 1}),
            r"unknown postuse.precut config keys \['beta'\]",
        ),
        (
            lambda: PostUseConfig(drafter=TalonSwitch()),
            "drafter must be a method config, not the part talon.switch",
        ),
    ]:
        with pytest.raises((ValueError, TypeError), match=message):
            build()


def test_cli_args_are_converted_by_their_annotation_without_eval():
    assert "eval(" not in inspect.getsource(hf_spec.core.config)
    assert parse_method("early-exit:6").exit_layer == 6
    assert parse_method("postuse:early-exit:3").drafter == "early-exit:3"
    assert parse_method("draft-model:some/folder").model == "some/folder"
    with pytest.raises(ValueError, match="expected int for exit_layer"):
        parse_method("early-exit:six")


@pytest.mark.parametrize("name", list_methods())
def test_configs_document_every_field(name):
    """PEFT-style configs: an `Args:` docstring naming every field, a paper link, help text on every field."""
    cls = get_method(name).config_cls
    doc = inspect.getdoc(cls) or ""
    assert "Args:" in doc and "https://" in doc, name
    args = doc.split("Args:", 1)[1]
    for f in dataclasses.fields(cls):
        assert f.metadata.get("help"), (name, f.name)
        assert f.name in args, (name, f.name)


@pytest.mark.parametrize("name", ["talon", "postuse"])
def test_config_parts_document_every_field(name):
    """Every part of a config (`ConfigPart`) has an `Args:` docstring naming its fields and help text on each."""
    cls = get_method(name).config_cls
    parts = [s.nested for s in config_schema(cls).values() if s.nested and issubclass(s.nested, ConfigPart)]
    assert len(parts) >= 3, name
    for part in parts:
        args = (inspect.getdoc(part) or "").split("Args:", 1)[-1]
        for f in dataclasses.fields(part):
            assert f.metadata.get("help") and f.name in args, (part.__name__, f.name)


def test_inference_never_imports_training():
    """Importing hf_spec, every method module, the decoder and the loop must not import `hf_spec.training`."""
    code = """
import importlib, pkgutil, sys
import hf_spec, hf_spec.decoder, hf_spec.engine, hf_spec.methods
for info in pkgutil.walk_packages(hf_spec.methods.__path__, "hf_spec.methods."):
    importlib.import_module(info.name)
for info in pkgutil.walk_packages(hf_spec.engine.__path__, "hf_spec.engine."):
    importlib.import_module(info.name)
print(sorted(m for m in sys.modules if m.startswith("hf_spec.training")))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def _parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_no_command_line_default_names_a_machine_path():
    """Defaults live under the user's cache or are required flags; `../shared` and absolute paths are for tests."""
    from hf_spec.cli.main import build_parser

    for parser in _parsers(build_parser()):
        for action in parser._actions:
            for value in action.default if isinstance(action.default, list) else [action.default]:
                if isinstance(value, str):
                    assert "shared" not in value and not value.startswith("/"), (
                        parser.prog,
                        action.dest,
                        value,
                    )
    from hf_spec.training import data

    assert not hasattr(data, "DEFAULT_PROMPTS")
