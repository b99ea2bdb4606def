"""Datastore build time, memory and lookup latency at 1M and 10M tokens (Talon issue; paper budget: a lookup
costs at most 0.1 of a target forward).

The corpus is a real datastore (`hf-spec datastore build ...`) repeated with its documents shuffled until the
size is reached (so search ranges and continuation counts grow as in a large corpus). Lookups are the
`retrieval` method's full per-round work: longest-suffix search (max 16 tokens), continuations of up to 256
occurrences, trie with cumulative frequencies, pruning to 16 nodes. Contexts are 64-token windows of the
corpus, half of them with the last token replaced by a random id (shorter matches).

    python lab/research/datastore_scale.py --datastore runs/ds-qwen --sizes 1000000,10000000
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import numpy as np

from hf_spec.datastore import TokenIndex
from hf_spec.datastore.suffix_array import SEP
from hf_spec.tree.retrieval import retrieval_tree


def repeated_corpus(text: np.ndarray, size: int, rng: np.random.Generator) -> np.ndarray:
    cuts = np.flatnonzero(text == SEP) + 1
    docs = np.split(text, cuts[:-1])
    out, total = [], 0
    while total < size:
        for i in rng.permutation(len(docs)):
            out.append(docs[i])
            total += len(docs[i])
            if total >= size:
                break
    return np.concatenate(out)


def lookup_ms(index: TokenIndex, rng: np.random.Generator, n: int = 300) -> tuple[np.ndarray, np.ndarray]:
    """Wall and CPU (process) milliseconds per lookup; CPU time is not inflated by other jobs on the machine."""
    text = index.text
    times, cpu = [], []
    for i in range(n):
        start = int(rng.integers(0, len(text) - 65))
        ctx = np.array(text[start : start + 64], dtype=np.int64)
        ctx = ctx[ctx >= 0]
        if i % 2:
            ctx[-1] = int(rng.integers(0, 150_000))
        t0, c0 = time.perf_counter(), time.process_time()
        m = index.search(ctx, max_len=16, depth=10)
        retrieval_tree(m.sequences.tolist(), m.counts.tolist(), 16)
        times.append(1000 * (time.perf_counter() - t0))
        cpu.append(1000 * (time.process_time() - c0))
    return np.array(times), np.array(cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datastore", required=True, help="a datastore folder (hf-spec datastore build)")
    parser.add_argument("--sizes", default="1000000,10000000")
    args = parser.parse_args()
    base = TokenIndex.load(args.datastore, mmap=False).text
    rng = np.random.default_rng(0)
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        corpus = repeated_corpus(base, size, rng)
        t0, c0 = time.perf_counter(), time.process_time()
        index = TokenIndex(corpus)
        build, build_cpu = time.perf_counter() - t0, time.process_time() - c0
        ms, cpu = lookup_ms(index, rng)
        rows.append(
            {
                "tokens": index.num_tokens,
                "build_s": round(build, 2),
                "build_cpu_s": round(build_cpu, 2),
                "index_mib": round(index.nbytes / 2**20, 1),
                "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                "lookup_ms_median": round(float(np.median(ms)), 3),
                "lookup_ms_p99": round(float(np.percentile(ms, 99)), 3),
                "lookup_cpu_ms_median": round(float(np.median(cpu)), 3),
                "lookup_cpu_ms_p99": round(float(np.percentile(cpu, 99)), 3),
                "lookup_cpu_ms_max": round(float(cpu.max()), 3),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    print(
        "| tokens | build s (CPU s) | index MiB | peak RSS MiB | lookup ms median / p99 | CPU ms median / p99 / max |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['tokens']:,} | {r['build_s']} ({r['build_cpu_s']}) | {r['index_mib']} | {r['peak_rss_mib']} | "
            f"{r['lookup_ms_median']} / {r['lookup_ms_p99']} | {r['lookup_cpu_ms_median']} / "
            f"{r['lookup_cpu_ms_p99']} / {r['lookup_cpu_ms_max']} |"
        )


if __name__ == "__main__":
    main()
