"""`hf-spec seal FOLDER`: give a head, exit-heads, export or datastore folder written by an earlier hf-spec a
complete checksum list, so that later loads check every file it ships."""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the `seal` sub-command."""
    from hf_spec.cli.common import examples

    parser = subparsers.add_parser(
        "seal",
        help="add a complete checksum list to a folder an earlier hf-spec wrote",
        description="Write hf_spec_checksums.json (the sha256 of every file) into a head, exit-heads, export or "
        "datastore folder that has none or lists only its weights, and mark its config.json (meta.json) so a "
        "copy without the list is refused. Seal only a folder you trust: what it holds now is what later loads "
        "accept. A folder whose list does not match is refused, not sealed.",
        **examples("hf-spec seal my-head", "hf-spec seal runs/exits-heads"),
    )
    parser.add_argument("folder", help="the folder to seal")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from hf_spec.io.integrity import seal_folder

    print(seal_folder(args.folder), flush=True)
    return 0
