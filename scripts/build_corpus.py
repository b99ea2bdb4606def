#!/usr/bin/env python
"""Rebuild the fixed-text training corpus of the draft heads (see data/corpus/PROVENANCE.md).

Downloads the pinned Debian and PyPI packages below (checked against their sha256) into
`$HF_SPEC_CACHE/corpus/sources`, reads their documentation and source text, adds the training prompts and the
targets' own answers from ../shared/data/train, drops every document that overlaps the evaluation prompts of
../shared/data/eval, and writes one corpus per target, in capture order, to
`$HF_SPEC_CACHE/corpus/<name>/<target>.jsonl` with `manifest-<target>.json` beside it (documents and tokens per
source, licences, checksums); `--manifest-dir data/corpus` also copies the manifests there (they are committed).

    .venv/bin/python scripts/build_corpus.py --manifest-dir data/corpus
    hf-spec data features --target qwen2.5-coder-0.5b-instruct --dtype bfloat16 --aux-layers eagle3 \\
        --corpus ~/.cache/hf-spec/corpus/v1/qwen2.5-coder-0.5b-instruct.jsonl --log capture.log
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from hf_spec.models.fetch import cache_root
from hf_spec.training.corpus import (
    EvalFilter,
    Source,
    answers,
    build_corpus,
    documents_from_file,
    documents_from_tree,
)

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared" / "data"
PSF = "PSF-2.0 (Python Software Foundation License; documentation examples 0BSD)"
DEBIAN = {  # package=version -> sha256 of the .deb
    "python3.11-doc=3.11.2-6+deb12u9": "5b3594189d6ef9a6963ce0347fd307a1cc67620ad697e144db366070e2e146be",
    "libpython3.11-stdlib=3.11.2-6+deb12u9": "10f13e000ee757f5f2d2d3569f9e30546214a0c850acd78695feae373bfa3e53",
    "libpython3.11-minimal=3.11.2-6+deb12u9": "69f41cfa3f4ba17284e538f843069d7529c53c207d2ae17a5b02785944870e33",
}
PYPI = {  # sdist -> (sha256, licence)
    "flask==3.1.3": ("0ef0e52b8a9cd932855379197dd8f94047b359ca0a78695144304cb45f87c9eb", "BSD-3-Clause"),
    "click==8.5.1": ("9bbfada76703fd1d784b83eea012e3e8c6a001a876543ef104fa56aaaeb072b4", "BSD-3-Clause"),
    "jinja2==3.1.6": ("0137fb05990d35f1275a587e9aee6d56da821fc83491a0fb838183be43f66d6d", "BSD-3-Clause"),
    "attrs==26.1.0": ("d03ceb89cb322a8fd706d4fb91940737b6642aa36998fe130a9bc96c985eff32", "MIT"),
    "pytest==9.2.0": ("97c4f3b1f3c7414aa36465e09b8220f1d03627993bd51b1282e193753c80557b", "MIT"),
    "requests==2.34.2": ("f288924cae4e29463698d6d60bc6a4da69c89185ad1e0bcc4104f584e960b9ed", "Apache-2.0"),
}
TARGETS = ("qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct")
CHANGELOGS = r"(^|/)(changes|changelog|history|announce|license|authors|contributing)[^/]*(/|\.|$)"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def apt_download_error(name: str, version: str, path: Path) -> str:
    """Why `apt-get download name=version` failed, from the versions the package lists name."""
    listed = subprocess.run(["apt-cache", "madison", name], capture_output=True, text=True).stdout
    served = [row.split("|")[1].strip() for row in listed.splitlines() if row.count("|") >= 2]
    if version in served:
        return f"apt-get could not download {name}={version} (its message is above)"
    return (
        f"{name}={version} is not in this machine's package lists (they name {', '.join(served) or 'no version'}): "
        "run `apt-get update` and try again. If it is still missing, Debian no longer serves it (its security "
        f"archive keeps only the newest version): its .deb from another mirror, put at {path}, rebuilds the same "
        "corpus (the sha256 is checked); another pin in DEBIAN builds one that differs from the committed manifests"
    )


def fetch(sources: Path) -> dict[str, Path]:
    """The pinned packages, downloaded once and checked: name=version -> archive path."""
    sources.mkdir(parents=True, exist_ok=True)
    got = {}
    for spec in DEBIAN:
        name, version = spec.split("=")
        path = sources / f"{name}_{version}_{'all' if name.endswith('-doc') else 'amd64'}.deb"
        if not path.exists():
            if shutil.which("apt-get") is None:
                raise SystemExit(
                    f"{spec} needs apt-get (Debian bookworm) to download it, or its .deb at {path}"
                )
            if subprocess.run(["apt-get", "download", spec], cwd=sources).returncode:
                raise SystemExit(apt_download_error(name, version, path))
        got[spec] = path
    for spec in PYPI:
        name, version = spec.split("==")
        path = sources / f"{name}-{version}.tar.gz"
        if not path.exists():
            pip = [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                "-d",
                str(sources),
            ]
            subprocess.run([*pip, spec], check=True)
        got[spec] = path
    for spec, path in got.items():
        want = DEBIAN.get(spec) or PYPI[spec][0]
        if sha256(path) != want:
            raise SystemExit(
                f"{path}: sha256 differs from the pinned one; delete it or update the pin in {__file__}"
            )
    return got


def unpack(archives: dict[str, Path], into: Path) -> None:
    into.mkdir(parents=True, exist_ok=True)
    for path in archives.values():
        if path.suffix == ".deb":
            subprocess.run(["dpkg-deb", "-x", str(path), str(into / "deb")], check=True)
        else:
            with tarfile.open(path) as tar:
                tar.extractall(into / "pypi", filter="data")


def fixed_text(root: Path) -> list[tuple[Source, list]]:
    """Sources every target shares: Python's documentation and standard library, permissive packages' docs and
    code, the Alpaca seed tasks."""
    deb, pypi = root / "deb", root / "pypi"
    groups = [
        (
            Source(
                "python-docs",
                PSF,
                "Debian bookworm python3.11-doc 3.11.2-6+deb12u9: html/_sources/*.rst.txt",
                max_tokens=2_000_000,
            ),
            documents_from_tree(
                "python-docs",
                deb / "usr/share/doc/python3.11/html/_sources",
                ["**/*.rst.txt"],
                "Write the Python 3.11 documentation page `{path}`{part}.",
                exclude=[r"whatsnew/changelog"],
            ),
        ),
        (
            Source(
                "python-stdlib",
                PSF,
                "Debian bookworm libpython3.11-stdlib + libpython3.11-minimal 3.11.2-6+deb12u9: /usr/lib/python3.11",
                max_tokens=1_600_000,
            ),
            documents_from_tree(
                "python-stdlib",
                deb / "usr/lib/python3.11",
                ["**/*.py"],
                "Show the Python standard library module `{path}`{part}.",
                exclude=[
                    r"(^|/)(tests?|idle_test|idlelib|pydoc_data|__phello__|encodings|lib2to3|site-packages)/"
                ],
            ),
        ),
    ]
    for spec, (_, licence) in PYPI.items():
        name, version = spec.split("==")
        top = pypi / f"{name}-{version}"
        docs = next((top / d for d in ("docs", "doc/en", "doc") if (top / d).is_dir()), None)
        if docs is not None:
            groups.append(
                (
                    Source(
                        f"pypi-docs-{name}",
                        licence,
                        f"PyPI sdist {name}-{version}.tar.gz: {docs.relative_to(top)}/",
                    ),
                    documents_from_tree(
                        f"pypi-docs-{name}",
                        docs,
                        ["**/*.rst", "**/*.md"],
                        f"Write the {name} documentation page `{{path}}`{{part}}.",
                        exclude=[CHANGELOGS],
                    ),
                )
            )
        groups.append(
            (
                Source(f"pypi-src-{name}", licence, f"PyPI sdist {name}-{version}.tar.gz: src/"),
                documents_from_tree(
                    f"pypi-src-{name}",
                    top / "src",
                    ["**/*.py"],
                    f"Show the {name} source file `{{path}}`{{part}}.",
                    exclude=[r"egg-info"],
                ),
            )
        )
    alpaca = SHARED / "train/alpaca_seed_tasks.jsonl"
    groups.append(
        (
            Source(
                "alpaca-seed",
                "CC BY-NC 4.0 (non-commercial)",
                "tatsu-lab/stanford_alpaca @ 761dc5bf seed_tasks.jsonl (../shared/data/train): instruction + human answer",
            ),
            documents_from_file("alpaca-seed", alpaca),
        )
    )
    return groups


def target_text(target: str) -> list[tuple[Source, list]]:
    """The target's own answers to ShareGPT prompts (first), and the prompts it has no answer to, as user text."""
    sharegpt = SHARED / "train/sharegpt_1000.json"
    responses = SHARED / f"train/responses/{target}.jsonl"
    origin = (
        "ml-energy/leaderboard-v2 @ 6244952578 ShareGPT_V3_filtered_1000 first turns (../shared/data/train)"
    )
    answered = answers("answers", responses, sharegpt) if responses.exists() else []
    have = {d.id.split("/", 1)[1] for d in answered}
    prompts = [
        d for d in documents_from_file("sharegpt-prompts", sharegpt) if d.id.split("/", 1)[1] not in have
    ]
    return [
        (
            Source(
                "answers",
                "ShareGPT prompt (licence unstated, research use) + the target's output (Apache-2.0 model)",
                f"{origin} + {target}'s greedy answers (../shared/data/train/responses/{target}.jsonl)",
                priority=0,
            ),
            answered,
        ),
        (
            Source(
                "sharegpt-prompts",
                "licence unstated (ShareGPT, research use)",
                origin + ": prompts not answered",
            ),
            prompts,
        ),
    ]


def token_counts(corpus: Path, target: str, max_len: int) -> dict[str, dict[str, int]]:
    from transformers import AutoTokenizer

    from hf_spec.models.fetch import resolve_model
    from hf_spec.training.corpus import read_documents
    from hf_spec.training.corpus_features import tokenize_document

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(target))
    counts: dict[str, dict[str, int]] = {}
    for doc in read_documents(corpus):
        ids, mask = tokenize_document(doc, tokenizer, max_len)
        row = counts.setdefault(doc.source, {"tokens": 0, "trained_tokens": 0})
        row["tokens"] += len(ids)
        row["trained_tokens"] += sum(mask)
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", default="v1", help="corpus name (folder under $HF_SPEC_CACHE/corpus)")
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--eval-dir", default=str(SHARED / "eval"), help="evaluation prompts to filter out")
    parser.add_argument("--max-len", type=int, default=1024, help="tokens kept per document (as captured)")
    parser.add_argument("--manifest-dir", help="also copy the manifests here (e.g. data/corpus)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    eval_files = sorted(Path(args.eval_dir).glob("*.jsonl"))
    if not eval_files:
        raise SystemExit(
            f"no evaluation prompts under {args.eval_dir}: the corpus cannot be checked against them"
        )
    eval_filter = EvalFilter.from_files(eval_files)
    root = cache_root() / "corpus"
    archives = fetch(root / "sources")
    unpack(archives, root / "unpacked")
    shared = fixed_text(root / "unpacked")
    out = root / args.name
    for target in args.targets.split(","):
        corpus = out / f"{target}.jsonl"
        manifest = build_corpus(target_text(target) + shared, eval_filter, corpus, seed=args.seed)
        manifest |= {
            "target": target,
            "eval_files": [p.name for p in eval_files],
            "archives": {spec: sha256(path) for spec, path in archives.items()},
            "max_len": args.max_len,
        }
        for source, counts in token_counts(corpus, target, args.max_len).items():
            manifest["sources"][source] |= counts
        manifest["tokens"] = sum(s.get("tokens", 0) for s in manifest["sources"].values())
        text = json.dumps(manifest, indent=1) + "\n"
        (out / f"manifest-{target}.json").write_text(text)
        if args.manifest_dir:
            Path(args.manifest_dir).mkdir(parents=True, exist_ok=True)
            (Path(args.manifest_dir) / f"manifest-{target}.json").write_text(text)
        print(f"{target}: {manifest['tokens']:,} tokens in {corpus}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
