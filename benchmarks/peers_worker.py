"""One engine process of `benchmarks/peers.py`: loads its engines, warms each up, then decodes what it is asked.

Run by `peers.py` with the Python of the engine's environment (hf-spec's own for `hf`, a side environment for
`vllm` and `llama`; see `benchmarks/peers/setup_envs.sh`), so it imports only the standard library at the top.
The protocol is one JSON object per line: requests on stdin, `{"engine": NAME, "ids": [...], "new": N,
"stop_at_eos": bool}`; answers on the file descriptor the process started with as stdout, `{"tokens": [...],
"seconds": S, ...}` (everything the libraries print goes to stderr). The first line written is
`{"ready": [NAME, ...], "info": {...}}` once every engine is loaded (peers.py warms each up); `{"error": ...}` answers a
request that failed.

    kind   engines (NAME)                                   what a call does
    hf     ar, hf-pld, any hf-spec method spec             `model.generate(do_sample=False)` via hf-spec bench's
                                                            `Method` (prefill included)
    vllm   vllm, vllm-ngram, vllm-eagle3                    one `LLM.generate` of one prompt, temperature 0
    llama  llama.cpp, llama.cpp-pld                         `Llama.generate` from an empty cache, greedy

Every call but the reference's makes exactly `new` tokens (the end-of-sequence token does not stop it); with
`stop_at_eos` (the reference, transformers' plain `generate`) it stops there as `generate` does.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def hf_engines(args: argparse.Namespace) -> tuple[dict, dict]:
    """`ar`, `hf-pld` and hf-spec methods on one transformers model, as `hf-spec bench` runs them."""
    import torch

    from hf_spec.bench.machine import machine_info
    from hf_spec.bench.runner import ForwardCounter, Method
    from hf_spec.models import load_model

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.target, dtype=getattr(torch, args.dtype), quantize=args.quantize)
    counter = ForwardCounter(model)
    methods = {name: Method(name, model, tokenizer, 8) for name in args.engines}
    # compiled engines: one static cache size, so the warm-up's compile serves every prompt
    if args.max_cache_len:
        for method in methods.values():
            method.fix_cache_length(args.max_cache_len)
    eos = model.generation_config.eos_token_id or tokenizer.eos_token_id  # every id `generate` stops at

    def make(method: Method):
        def call(ids: list[int], new: int, stop_at_eos: bool) -> dict:
            method.kwargs["max_new_tokens"] = new
            # the reference stops at the end of sequence; every other row of transformers' loop makes exactly `new`
            # tokens, as the other engines do, by not stopping at it (`min_new_tokens` would mask it instead, at the
            # cost of a vocabulary-wide `isin` a step that the reference does not pay); hf-spec's loop stops at
            # the end of sequence itself, where the reference did when lossless
            method.kwargs.pop("eos_token_id", None)
            if not stop_at_eos and method.decoder is None:
                method.kwargs["eos_token_id"] = None
            out, row = method.generate(torch.tensor([ids]), None, counter)
            answer = {"tokens": out[0, len(ids) :].tolist(), "seconds": row["seconds"], "tau": row["tau"]}
            if "stats" in row:
                stats = row["stats"]
                answer["acceptance"] = {
                    "target_forwards": stats["target_forwards"],
                    "accepted_tokens": stats["accepted_tokens"],
                    "draft_tokens": stats["draft_tokens"],
                    "depth_tries": stats["depth_tries"],
                    "depth_hits": stats["depth_hits"],
                }
            return answer

        return call

    info = machine_info() | {"eos": eos}
    return {name: make(m) for name, m in methods.items()}, info


def vllm_engines(args: argparse.Namespace) -> tuple[dict, dict]:
    """vLLM's offline `LLM` on the target folder, plain or with its n-gram or EAGLE-3 speculation."""
    # KV cache in GiB (the default takes far more than one prompt needs); the threads on cores 0..threads-1; the
    # engine core in this process (no second process polling while another engine runs)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import vllm
    from vllm import LLM, SamplingParams

    if len(args.engines) != 1:
        raise ValueError("one vLLM engine per process")
    name = args.engines[0]
    spec = {
        "vllm": None,
        "vllm-ngram": {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
                       "prompt_lookup_max": 4, "prompt_lookup_min": 2},
        "vllm-eagle3": {"method": "eagle3", "model": args.draft, "num_speculative_tokens":
                        args.num_speculative_tokens},
    }[name]  # fmt: skip
    llm = LLM(
        model=args.target,
        dtype=args.dtype,
        seed=0,
        max_model_len=args.max_model_len,
        enable_prefix_caching=False,  # every call prefills its whole prompt, as the other engines do
        disable_log_stats=False,  # keeps the speculative-decoding counters `get_metrics` reads
        speculative_config=spec,
    )

    def counters() -> dict:
        """vLLM's cumulative speculative-decoding counters: drafts, draft tokens, accepted, accepted per position."""
        got: dict = {}
        for m in llm.get_metrics():
            value = getattr(m, "values", None) or getattr(m, "value", None)  # Vector, Counter (not Histogram)
            if m.name.startswith("vllm:spec_decode") and value is not None:
                key = m.name.removeprefix("vllm:spec_decode_")
                got[key] = list(value) if isinstance(value, list) else value
        return got

    def call(ids: list[int], new: int, stop_at_eos: bool) -> dict:
        params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=not stop_at_eos, detokenize=False)
        before = counters()
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        after = counters()
        answer = {"tokens": list(out[0].outputs[0].token_ids), "seconds": seconds}
        if spec is not None:
            answer["acceptance"] = {k: _minus(v, before.get(k)) for k, v in after.items()}
        return answer

    return {name: call}, {"vllm": vllm.__version__, "speculative_config": spec}


def _minus(after, before):
    if isinstance(after, list):
        before = before or [0] * len(after)
        return [a - b for a, b in zip(after, before, strict=False)]
    return after - (before or 0)


def llama_engines(args: argparse.Namespace) -> tuple[dict, dict]:
    """llama.cpp (llama-cpp-python) on the GGUF, plain or with `LlamaPromptLookupDecoding`."""
    import llama_cpp
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    engines = {}
    for name in args.engines:
        draft = {"llama.cpp": None, "llama.cpp-pld": LlamaPromptLookupDecoding(num_pred_tokens=10)}[name]
        llm = Llama(
            model_path=args.target,
            n_ctx=args.max_model_len,
            n_threads=args.threads,
            n_threads_batch=args.threads,
            draft_model=draft,
            verbose=False,
        )

        def call(ids: list[int], new: int, stop_at_eos: bool, llm=llm) -> dict:
            llm.reset()  # no prefix of an earlier call is reused
            tokens: list[int] = []
            t0 = time.perf_counter()
            for token in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, repeat_penalty=1.0, reset=True):
                tokens.append(int(token))
                if len(tokens) >= new or (stop_at_eos and token == llm.token_eos()):
                    break
            return {"tokens": tokens, "seconds": time.perf_counter() - t0}

        engines[name] = call
    return engines, {"llama_cpp_python": llama_cpp.__version__}


KINDS = {"hf": hf_engines, "vllm": vllm_engines, "llama": llama_engines}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kind", choices=sorted(KINDS), required=True)
    p.add_argument("--target", required=True, help="target folder (hf, vllm) or GGUF file (llama)")
    p.add_argument("--engines", required=True, help="JSON list of the engine names this process serves")
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantize", default=None, help="hf: load the target on hf-spec's quantized CPU kernels")
    p.add_argument("--draft", default=None, help="vllm-eagle3: the exported head folder")
    p.add_argument("--num-speculative-tokens", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument(
        "--max-cache-len",
        type=int,
        default=None,
        help="hf: the static cache of compiled engines, in tokens (the longest prompt and its new tokens)",
    )
    args = p.parse_args()
    args.engines = json.loads(args.engines)
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever the libraries print goes to stderr, never into the answers
    sys.stdout = sys.stderr
    engines, info = KINDS[args.kind](args)
    answers.write(json.dumps({"ready": list(engines), "info": info}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        try:
            answer = engines[request["engine"]](
                request["ids"], request["new"], request.get("stop_at_eos", False)
            )
        except Exception as err:  # reported to peers.py, which stops the run naming the engine
            answer = {"error": f"{type(err).__name__}: {err}"}
        answers.write(json.dumps(answer) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
