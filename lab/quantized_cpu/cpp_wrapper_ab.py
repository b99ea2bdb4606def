"""The compiled verification forward of the Qwen GGUF target with inductor's Python wrapper (the default) against
its C++ wrapper (`cpp_wrapper`, built apart from the kernels: `cpp_wrapper_build_separate`), alternated call by call
in one process (the machine's speed drifts too much for two runs to compare): compile seconds, median milliseconds a
call, and whether both give the same logits.

The Python wrapper calls each of a forward's few hundred kernels and operators from Python; the C++ wrapper makes
those calls from compiled code.

    python lab/quantized_cpu/cpp_wrapper_ab.py [--widths 1,4] [--calls 40] [--threads 2]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hf_spec.engine.target.compiled import CompiledVerifier, CompileSettings, owned_static_cache  # noqa: E402
from hf_spec.engine.target.static import rewindable_static_cache  # noqa: E402
from hf_spec.models.fetch import load_model  # noqa: E402
from hf_spec.tree.draft_tree import DraftTree  # noqa: E402

VARIANTS = {
    "Python wrapper": {"cpp_wrapper": False},
    "C++ wrapper": {"cpp_wrapper": True, "cpp_wrapper_build_separate": True},
}
PROMPT = "Write a Python function that reverses a string, and explain how it works step by step."


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--widths", default="1,4", help="verification widths (rows a forward)")
    p.add_argument("--calls", type=int, default=40, help="calls of each variant at each width")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.target, dtype=torch.bfloat16, quantize="gguf")
    ids = tok(PROMPT, return_tensors="pt").input_ids
    cache = owned_static_cache(model, None, 400)
    print(
        f"torch {torch.__version__}, {args.threads} threads, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    print("\n| width | variant | compile (s) | ms a call (median) | same logits as the Python wrapper |")
    print("|---|---|---|---|---|")
    with rewindable_static_cache(cache, 400), torch.no_grad():
        # the hidden states an EAGLE-3 round asks for; the eager prompt forward installs transformers' capture hooks
        model(input_ids=ids, past_key_values=cache, use_cache=True, output_hidden_states=True)
        past, root = ids.shape[1], ids[:, -1:]

        def call(verifier: CompiledVerifier, tree: DraftTree, width: int) -> torch.Tensor:
            out = verifier(root, tree, past, width, True)
            for layer in cache.layers:
                layer.crop_to(past)
            return out.logits.clone()

        for width in (int(w) for w in args.widths.split(",")):
            tree = DraftTree.chain([int(root[0, 0])] * (width - 1))
            verifiers, compile_s = {}, {}
            for name, options in VARIANTS.items():
                verifiers[name] = CompiledVerifier(model, cache, CompileSettings(options=options))
                start = time.perf_counter()
                call(verifiers[name], tree, width)
                compile_s[name] = time.perf_counter() - start
            times = {name: [] for name in VARIANTS}
            logits = {}
            for _ in range(args.calls):
                for name, verifier in verifiers.items():
                    start = time.perf_counter()
                    logits[name] = call(verifier, tree, width)
                    times[name].append(time.perf_counter() - start)
            base = logits["Python wrapper"]
            for name in VARIANTS:
                same = "yes" if torch.equal(logits[name], base) else "NO"
                print(
                    f"| {width} | {name} | {compile_s[name]:.1f} | {statistics.median(times[name]) * 1e3:.2f} | "
                    f"{same} |"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
