"""Write docs/cli.md, the command-line reference, from the `hf-spec` parsers themselves.

    python scripts/cli_reference.py            # rewrite docs/cli.md
    python scripts/cli_reference.py --check    # exit 1 if docs/cli.md is out of date (tests/test_cli_reference.py)

Every command and sub-command gets a section: what it does, a table of its options (name, default, help) and the
examples of its `--help`. Hidden options (the old spellings kept as deprecated aliases) are left out.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the checkout's hf_spec, also when not installed in editable mode

from hf_spec.cli.common import EXAMPLES_HEADER  # noqa: E402
from hf_spec.cli.main import build_parser  # noqa: E402

PAGE = REPO / "docs" / "cli.md"

INTRO = """# Command line

<!-- written by scripts/cli_reference.py from the parsers: edit the parsers, then run it -->

`hf-spec` is installed with the package ([Getting started](getting-started.md) says how).
`hf-spec --version` prints the version, `hf-spec COMMAND --help` what this page says about a command.

The commands share one vocabulary: `--target` (a known name, a local folder or a Hub id), `--prompts` (prompt
files), `--data-dir` (the training-data cache), `--epochs`, `--topk`, `--dtype`, `--device`, `--threads` and
`--out` mean the same everywhere they appear. `--dtype` is the target's dtype; it defaults to `bfloat16` (the dtype
of the published figures) in the commands that decode or time decoding (`generate`, `bench`, `sweep`,
`train postuse`) and to `float32` in those that build training data or check exactness (`data`, `eval-head`,
`datastore build`, `train exits`, `check`), the dtype heads and their fingerprints are defined in. In
`train eagle`, `train eagle3` and `train lyanna`, `--dtype` is the head's compute dtype while training.

Exit status: 0 on success; 2 on bad input (a usage error, a missing or malformed file, a model or head that does
not fit), after a one-line `hf-spec: error: ...` (`HF_SPEC_DEBUG=1` shows the traceback); 1 where a command says
so (`check`: the model cannot verify trees); 130 when interrupted. Old option spellings
(`--precision`, `--top-k`, `--data`, `--from`) still work for now and print a `FutureWarning` naming the new one.
"""


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser]]:
    """`(name, parser)` of each sub-command of `parser`, in the order they were added."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            out += list(action.choices.items())
    return out


def _help_of(parser: argparse.ArgumentParser, name: str) -> str:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                if choice.dest == name:
                    return choice.help or ""
    return ""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _option_rows(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(
            action, (argparse._HelpAction, argparse._SubParsersAction)
        ):
            continue
        value = action.metavar or action.dest.upper()
        if action.choices:
            value = "{" + ",".join(map(str, action.choices)) + "}"
        if action.option_strings:
            name = ", ".join(action.option_strings) + (f" {value}" if action.nargs != 0 else "")
        else:
            name = value if action.choices else action.metavar or action.dest
        default = action.default
        shown = "" if default in (None, False, argparse.SUPPRESS, []) or action.nargs == 0 else f"`{default}`"
        if action.required:
            shown = "required"
        help_text = action.help or ""
        if "%(" in help_text:
            help_text = help_text % {"default": default, "prog": parser.prog}
        rows.append(f"| `{_cell(name)}` | {shown} | {_cell(help_text)} |")
    return rows


def _section(path: str, parser: argparse.ArgumentParser, summary: str, level: int) -> list[str]:
    lines = [f"{'#' * level} `{path}`", ""]
    about = parser.description or summary
    if about:
        lines += [about, ""]
    rows = _option_rows(parser)
    if rows:
        lines += ["| option | default | what it does |", "|---|---|---|", *rows, ""]
    if parser.epilog and parser.epilog.startswith(EXAMPLES_HEADER):
        body = [line.strip() for line in parser.epilog.splitlines()[1:] if line.strip()]
        lines += ["```bash", *body, "```", ""]
    for name, sub in _subcommands(parser):
        lines += _section(f"{path} {name}", sub, _help_of(parser, name), min(level + 1, 4))
    return lines


def render() -> str:
    parser = build_parser()
    lines = [INTRO]
    for name, sub in _subcommands(parser):
        lines += _section(f"hf-spec {name}", sub, _help_of(parser, name), 2)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument(
        "--check", action="store_true", help="fail if docs/cli.md is out of date; write nothing"
    )
    check = args.parse_args(argv).check
    text = render()
    if check:
        if PAGE.read_text() != text:
            print("docs/cli.md is out of date: run python scripts/cli_reference.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
