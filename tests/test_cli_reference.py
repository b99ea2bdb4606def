"""The command line's one vocabulary: the reference page matches the parsers, every command shows examples,
old option spellings still work and warn, `--version`, and exit status 2 for bad input everywhere."""

from __future__ import annotations

import argparse
import importlib.util
import shlex
import warnings
from pathlib import Path

import pytest

from hf_spec import __version__
from hf_spec.cli.common import EXAMPLES_HEADER
from hf_spec.cli.main import build_parser, console_main

REPO = Path(__file__).resolve().parents[1]


def _reference():
    spec = importlib.util.spec_from_file_location("cli_reference", REPO / "scripts" / "cli_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _leaves(parser: argparse.ArgumentParser, path: str = "hf-spec"):
    """`(command path, parser)` of every command that runs something (no sub-commands of its own)."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
    for action in subs:
        for name, sub in action.choices.items():
            yield from _leaves(sub, f"{path} {name}")


def test_cli_reference_page_is_up_to_date():
    """docs/cli.md is what scripts/cli_reference.py writes from the parsers (run it after changing a parser)."""
    assert (REPO / "docs" / "cli.md").read_text() == _reference().render()


def test_every_command_has_examples_that_parse():
    """Each command's --help ends with examples, and each example parses with that command's parser."""
    parser = build_parser()
    leaves = dict(_leaves(parser))
    assert {"hf-spec bench", "hf-spec train eagle", "hf-spec train exits", "hf-spec datastore build"} <= set(
        leaves
    )
    for path, sub in leaves.items():
        assert sub.epilog and sub.epilog.startswith(EXAMPLES_HEADER), f"{path} has no examples"
        for line in sub.epilog.splitlines()[1:]:
            argv = shlex.split(line, comments=True)
            if "|" in line or "--help" in argv:
                continue
            assert " ".join(argv[: len(path.split())]) == path, f"{path}: example of another command: {line}"
            parser.parse_args(argv[1:])  # raises SystemExit(2) on an example the parser refuses


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"hf-spec {__version__}"


@pytest.mark.parametrize(
    ("argv", "dest", "value", "new"),
    [
        (
            ["train", "eagle", "--target", "t", "--out", "o", "--precision", "bf16"],
            "precision",
            "bfloat16",
            "--dtype",
        ),
        (
            ["train", "eagle3", "--target", "t", "--out", "o", "--precision", "fp32"],
            "precision",
            "float32",
            "--dtype",
        ),
        (
            ["train", "exits", "--target", "t", "--layers", "2", "--out", "o", "--data", "a.jsonl"],
            "responses",
            "a.jsonl",
            "--responses",
        ),
        (
            [
                "train",
                "exits",
                "--target",
                "t",
                "--layers",
                "2",
                "--out",
                "o",
                "--responses",
                "a",
                "--top-k",
                "8",
            ],
            "topk",
            8,
            "--topk",
        ),
        (
            ["datastore", "build", "--target", "t", "--out", "o", "--from", "a.json"],
            "corpus",
            ["a.json"],
            "--corpus",
        ),
    ],
)
def test_old_spellings_still_work_and_warn(argv, dest, value, new):
    with pytest.warns(FutureWarning, match=f"deprecated and will be removed; use {new}"):
        args = build_parser().parse_args(argv)
    assert getattr(args, dest) == value


def test_old_spellings_are_hidden_and_checked(capsys):
    parser = build_parser()
    docs = (REPO / "docs" / "cli.md").read_text()
    for old in ("--precision ", "--top-k ", "--from "):
        assert f"`{old}" not in docs, old
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args(["train", "eagle", "--target", "t", "--out", "o", "--precision", "fp64"])
    assert exit_.value.code == 2 and "fp64" in capsys.readouterr().err


def test_new_spellings_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        args = build_parser().parse_args(
            [
                "train",
                "exits",
                "--target",
                "t",
                "--layers",
                "2",
                "--out",
                "o",
                "--responses",
                "a",
                "--topk",
                "8",
            ]
        )
    assert (args.responses, args.topk) == ("a", 8)


def test_dtype_defaults_follow_the_command_role():
    """Decoding and timing commands default to bfloat16 (the published figures' dtype), data and exactness
    commands to float32, the trainers' compute dtype to auto."""
    parser = build_parser()
    common = ["--target", "t"]
    runs = {
        "bfloat16": [
            ["generate"],
            ["bench", *common, "--methods", "ar", "--prompts", "p", "--out", "o"],
            [
                "sweep",
                "hispec",
                *common,
                "--prompts",
                "p",
                "--draft-layers",
                "1",
                "--verify-layers",
                "2",
                "--out",
                "o",
            ],
            ["train", "postuse", *common, "--config", "c", "--prompts", "p", "--out", "o"],
        ],
        "float32": [
            ["check", *common],
            ["data", "responses", *common, "--prompts", "p"],
            ["data", "features", *common],
            ["eval-head", *common, "--head", "h"],
            ["datastore", "build", *common, "--out", "o"],
            ["train", "exits", *common, "--layers", "2", "--responses", "r", "--out", "o"],
        ],
    }
    for dtype, commands in runs.items():
        for argv in commands:
            assert parser.parse_args(argv).dtype == dtype, argv
    for trainer in ("eagle", "eagle3", "lyanna"):
        assert parser.parse_args(["train", trainer, *common, "--out", "o"]).precision == "auto"


def test_fetch_failure_exits_2(monkeypatch, capsys):
    from hf_spec.models import fetch

    def fail(*args, **kwargs):
        raise fetch.FetchError("no network")

    monkeypatch.setattr("hf_spec.cli.fetch.fetch_model", fail)
    assert console_main(["fetch", "smollm2-135m-instruct"]) == 2
    assert "no network" in capsys.readouterr().err


def test_usage_errors_exit_2(capsys):
    for argv in (["bench", "--target", "t"], ["train", "exits", "--target", "t"], ["no-such-command"]):
        with pytest.raises(SystemExit) as exit_:
            console_main(argv)
        assert exit_.value.code == 2, argv
    capsys.readouterr()


def test_postuse_bad_config_is_an_input_error(tmp_path, capsys, monkeypatch):
    """A config without a Q-table to learn ends in a one-line error and status 2, not a bare SystemExit."""
    monkeypatch.delenv("HF_SPEC_DEBUG", raising=False)
    config = tmp_path / "postuse.json"
    config.write_text('{"method": "postuse", "precut": false}')
    argv = [
        "train",
        "postuse",
        "--target",
        "t",
        "--config",
        str(config),
        "--prompts",
        "p",
        "--out",
        str(tmp_path / "q.json"),
    ]
    assert console_main(argv) == 2
    assert "precut off" in capsys.readouterr().err
