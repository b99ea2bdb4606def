"""Hugging Face Hub ids wherever hf-spec takes a folder: a draft head, exit heads, a saved config, a
`custom_generate` folder.

A name is a Hub id when no local file or folder of that name exists and it reads `org/name` or
`org/name@revision` (a branch, tag or commit). It is resolved by `huggingface_hub.snapshot_download`, so the
Hub client's own rules hold: `HF_HUB_OFFLINE=1` uses the local cache only, `HF_HOME` / `HF_HUB_CACHE` say where
that cache is, a token (`HF_TOKEN` or `hf auth login`) opens private and gated repos, and a repo downloaded once
is not downloaded again. The result is the local snapshot folder, laid out as the repo is.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

# `org/name` with an optional `@revision`; a revision may hold slashes (`refs/pr/3`)
_HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?")

# the files a draft head needs; a repo's weights are fetched in one format only (see `resolve_head_folder`)
HEAD_CONFIG_FILES = (
    "config.json",
    "hf_spec_config.json",
    "hf_spec.json",
    "README.md",
    "hf_spec_checksums.json",
)
SAFETENSORS_FILES = ("*.safetensors", "*.safetensors.index.json")
PICKLE_FILES = ("pytorch_model*.bin", "pytorch_model.bin.index.json")


class HubIdError(ValueError):
    """A Hub id could not be resolved to a local folder (offline and not cached, unknown repo, no access)."""


def parse_hub_id(name: str | os.PathLike) -> tuple[str, str | None] | None:
    """`(repo_id, revision or None)` when `name` is a Hub id, None when it is a local path or no Hub id.

    Example: `"yuhuili/EAGLE-LLaMA3-Instruct-8B@main"` -> `("yuhuili/EAGLE-LLaMA3-Instruct-8B", "main")`;
    `"./heads/eagle"`, an existing folder `heads/eagle` or a `.json` file name -> None.
    """
    text = os.fspath(name)
    if not text or text.endswith(".json") or os.path.exists(os.path.expanduser(text)):
        return None
    match = _HUB_ID.fullmatch(text)
    if match is None:
        return None
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(match["repo"])
    except ValueError:  # `..`, `--`, a leading or trailing `.`/`-`: not a repo id the Hub allows
        return None
    return match["repo"], match["revision"]


def resolve_folder(name: str | os.PathLike, what: str, allow_patterns: Sequence[str] | None = None) -> str:
    """The local folder `name` names: itself when it is a local path, else the snapshot of the Hub repo it names
    (only the files matching `allow_patterns` when given, every file otherwise). `what` names the thing in
    errors (e.g. "eagle head"). Raises `HubIdError` naming the repo when it cannot be had."""
    hub = parse_hub_id(name)
    if hub is None:
        return os.fspath(name)
    repo, revision = hub
    return _snapshot(repo, revision, what, os.fspath(name), list(allow_patterns) if allow_patterns else None)


def resolve_head_folder(name: str | os.PathLike, what: str) -> str:
    """Like `resolve_folder` for a draft head: its configs and its weights, as safetensors when the repo has them
    and else as `pytorch_model*.bin` (so a repo holding both formats is fetched once, in the safe one)."""
    hub = parse_hub_id(name)
    if hub is None:
        return os.fspath(name)
    repo, revision = hub
    text = os.fspath(name)
    folder = _snapshot(repo, revision, what, text, [*HEAD_CONFIG_FILES, *SAFETENSORS_FILES])
    listed = _listed_files(folder)
    if listed:  # a folder hf-spec wrote: every file its checksum list names, which the load checks
        return _snapshot(repo, revision, what, text, [*HEAD_CONFIG_FILES, *SAFETENSORS_FILES, *listed])
    if any(f.endswith(".safetensors") for f in os.listdir(folder)):
        return folder
    return _snapshot(repo, revision, what, text, [*HEAD_CONFIG_FILES, *PICKLE_FILES])


def _listed_files(folder: str) -> list[str]:
    """The file names `folder`'s `hf_spec_checksums.json` lists (none without one; a damaged list is left for the
    load to name), as exact `allow_patterns`."""
    import glob
    import json

    try:
        with open(os.path.join(folder, "hf_spec_checksums.json")) as f:
            files = json.load(f).get("files")
    except (OSError, ValueError, AttributeError):
        return []
    return [glob.escape(name) for name in files if isinstance(name, str)] if isinstance(files, dict) else []


def _snapshot(repo: str, revision: str | None, what: str, name: str, allow_patterns: list[str] | None) -> str:
    from huggingface_hub import constants, errors, snapshot_download

    at = f"{repo!r}" + (f" at revision {revision!r}" if revision else "")
    local = f"there is no local folder {name!r}, and the Hugging Face Hub repo {at}"
    incomplete = getattr(errors, "IncompleteSnapshotError", ())
    try:
        # offline, the cache is all there is: said explicitly, since some huggingface_hub versions still try to
        # list a commit's files on the Hub when the revision is a commit hash
        offline = bool(constants.HF_HUB_OFFLINE)
        return snapshot_download(
            repo, revision=revision, allow_patterns=allow_patterns, local_files_only=offline
        )
    except (errors.RepositoryNotFoundError, errors.GatedRepoError) as err:
        raise HubIdError(
            f"{what} {name!r}: {local} does not exist or needs access (log in with `hf auth login` or set "
            f"HF_TOKEN; a gated repo also needs its terms accepted): {type(err).__name__}"
        ) from None
    except errors.RevisionNotFoundError:
        raise HubIdError(f"{what} {name!r}: {local} has no revision {revision!r}") from None
    except incomplete as err:
        raise HubIdError(
            f"{what} {name!r}: the cached snapshot of {at} lacks files and the Hub cannot be reached to complete "
            f"it: {err}"
        ) from None
    except errors.LocalEntryNotFoundError:
        cache = constants.HF_HUB_CACHE
        why = (
            "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the Hub cannot be reached (no network?)"
        )
        raise HubIdError(
            f"{what} {name!r}: {local} is not in the local Hugging Face cache ({cache}) and {why}: download it once "
            f"where the Hub is reachable (`hf download {repo}`), or pass a local folder"
        ) from None
    except errors.HfHubHTTPError as err:
        raise HubIdError(f"{what} {name!r}: the Hub refused {at}: {err}") from None
