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
from pathlib import Path

import pytest

import hf_spec.core.config
from hf_spec.core.config import CONFIG_VERSION, MethodConfig, config_schema
from hf_spec.core.config_paths import resolve_spec
from hf_spec.core.registry import get_method, list_methods
from hf_spec.core.specs import parse_method
from hf_spec.kernels.weight_only import SCHEMES
from hf_spec.methods.early_exit.config import EarlyExitConfig
from hf_spec.methods.lyanna.config import LyannaConfig
from hf_spec.methods.postuse.config import PostUseConfig
from hf_spec.methods.retrieval.config import RetrievalConfig
from hf_spec.methods.talon.config import TalonConfig

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
        if key == "method":
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
    config = TalonConfig(retrieval={"max_nodes": 8, "prompt_lookup": 3}, drafter="early-exit:2", both_nodes=4)
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
    assert PostUseConfig.from_dict({"keep_cache": True, "q_table": ""}).q_table is None
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
    with pytest.raises(ValueError, match=r"talon: mode must be 'sync' or 'async', got 'parallel'"):
        TalonConfig(mode="parallel")
    with pytest.raises(ValueError, match=r"quantize must be 'int8', 'int4' or None, got 'int3'"):
        EarlyExitConfig(quantize="int3")
    with pytest.raises(ValueError, match=r"resample must be 'off', 'separate' or 'fused', got True"):
        LyannaConfig(resample=True)
    with pytest.raises(ValueError, match=r"reward must be 'useful', 'accepted' or 'committed'"):
        PostUseConfig(reward="speed")
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
