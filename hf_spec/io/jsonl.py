"""Reading JSON and JSON Lines files with errors that name the file and the line."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def read_json(path: str | os.PathLike) -> Any:
    """The JSON value in `path`; a `ValueError` names the file, line and column of a syntax error."""
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}:{err.lineno}: not valid JSON ({err.msg}, column {err.colno})") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not a UTF-8 text file ({err.reason} at byte {err.start})") from None


def read_jsonl(path: str | os.PathLike) -> list[tuple[int, Any]]:
    """`(line number, value)` of every non-blank line of the JSON Lines file `path`; a `ValueError` names the file
    and line of a line that is not valid JSON."""
    rows = []
    try:
        text = Path(path).read_text()
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not a UTF-8 text file ({err.reason} at byte {err.start})") from None
    for line_no, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append((line_no, json.loads(line)))
        except json.JSONDecodeError as err:
            raise ValueError(
                f"{path}:{line_no}: not valid JSON ({err.msg}, column {err.colno}); a .jsonl file holds one "
                "JSON object per line"
            ) from None
    return rows


def jsonl_values(path: str | os.PathLike) -> list[Any]:
    """The values of `read_jsonl(path)`, without their line numbers."""
    return [value for _, value in read_jsonl(path)]
