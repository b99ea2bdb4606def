"""How fast HiSpec could be on this machine, at best, against the single-exit drafter: measured stage costs and
measured exit agreement, no Python overhead.

1. Greedy continuations of Spec-Bench prompts; one teacher-forced forward of each gives every exit's argmax (and
   top-k) at every continuation position, and the final layer's argmax.
2. The stage costs, timed in hf-spec's loop settings (its kernels and attention, the screened LM head) after a
   prompt of `--context` tokens: a draft step through [0, L) + the exit at L (one row; exact or packed weights),
   an intermediate check through [L_d, L_i) + the exit at L_i (N_d rows), HiSpec's final pass through [L_i, L_f)
   + the LM head, and a full verification.
3. Both algorithms replayed on the continuations with those predictions (HiSpec: paper Algorithm 2 as
   `hf_spec/methods/hispec/drafter.py` runs it; early exit: a chain of N drafts), each round costed with step 2's
   times: ms per committed token for every (L_d, L_i, N_d, N_i) and for the single exit.

`--topk K` also replays an idealised HiSpec whose intermediate check accepts a draft whenever the L_i exit's token
is in the L_d exit's top K (a free K-wide draft tree: same costs as the chain).

Usage: python lab/research/hispec_bound.py [--dtype bfloat16] [--prompts F] [--count 13] [--max-new-tokens 96]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

import torch

from hf_spec.bench.runner import encode_chat, load_prompts
from hf_spec.core.compat import cache_kwargs
from hf_spec.engine.target.cache import crop_cache
from hf_spec.kernels.grouped_attention import grouped_attention
from hf_spec.kernels.screened_head import screened_lm_head
from hf_spec.kernels.skinny_linear import fast_linears
from hf_spec.kernels.weight_only import draft_linears
from hf_spec.methods.early_exit.drafter import quantize_draft_layers
from hf_spec.methods.early_exit.exit_heads import load_exit_lm
from hf_spec.models import load_model
from hf_spec.models.layers import decoder_parts, run_layers
from hf_spec.tree.masks import causal_mask


def greedy_continuations(model, tok, path: str, max_new_tokens: int, per_category: int = 1, limit=None):
    """`(prompt, ids (1, T), start)` per Spec-Bench prompt (the first `per_category` of each category, then
    `limit`): plain greedy `generate` of its first turn; position `start` predicts the first new token."""
    texts = []
    for p in load_prompts(path, limit=limit, per_category=per_category):
        ids = encode_chat(tok, [{"role": "user", "content": p.turns[0]}])
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
        )
        texts.append((p, out, ids.shape[1] - 1))
    return texts


def predictions(model, exits, layers, texts, topk):
    """Per text: final argmax `[T]`, and per exit layer its argmax `[T]` and top-k `[T, k]` at the continuation
    positions (position t predicts token t + 1)."""
    out = []
    with torch.no_grad():
        for _, ids, start in texts:
            res = model(ids, output_hidden_states=True)
            final = res.logits[0, start:].float().argmax(-1)
            per_layer = {}
            for k in layers:
                logits = exits.logits(k, res.hidden_states[k][:, start:])[0].float()
                per_layer[k] = (logits.argmax(-1), logits.topk(topk, dim=-1).indices)
            out.append((final, per_layer))
    return out


def timed(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def context_cache(model, context_ids: torch.Tensor):
    """The model's KV cache of `context_ids` `(1, past)` and its hidden states (one tensor per layer)."""
    with torch.no_grad():
        res = model(context_ids, use_cache=True, output_hidden_states=True)
    cache = res.past_key_values if getattr(res, "past_key_values", None) is not None else res.cache
    return cache, res.hidden_states


def draft_step(model, cache, context_ids: torch.Tensor, layer: int, weights, exits):
    """A callable: one draft step after the cached context, layers [0, `layer`) with `weights` (packed copies or
    `{}`) + the exit at `layer`; the cache is cropped back."""
    parts, past = decoder_parts(model), context_ids.shape[1]
    tok = context_ids[:, -1:]

    def run():
        with draft_linears(model, weights):
            h = run_layers(parts, parts.embed_tokens(tok), torch.tensor([[past]]), cache, 0, layer)
            exits.logits(layer, h)[0, -1].float().argmax()
        crop_cache(cache, past)

    return run


def verification(model, cache, context_ids: torch.Tensor, n: int):
    """A callable: the full forward of `n` chain rows after the cached context, on hf-spec's kernels with the
    screened LM head (the loop's greedy verification); the cache is cropped back."""
    past, ids = context_ids.shape[1], context_ids[:, -n:]

    def run():
        with screened_lm_head(model), fast_linears(model):
            out = model(
                input_ids=ids,
                position_ids=torch.arange(past, past + n).unsqueeze(0),
                use_cache=True,
                **cache_kwargs(model, cache),
            )
            out.logits[0].float().argmax(-1)
        crop_cache(cache, past)

    return run


def stage_costs(model, exits, packed_exits, layers, context_ids, n_rows, reps, quantized):
    """ms of each stage with `context_ids` cached (hf-spec's loop contexts); the rows fed to a stage are the
    context's own hidden states at its first layer."""
    parts = decoder_parts(model)
    depth = parts.num_layers
    cache, hidden = context_cache(model, context_ids)
    past = context_ids.shape[1]
    costs: dict = {}

    def rows(n, layer):
        return hidden[layer][:, -n:].contiguous()

    def block(start, end, n):
        """Layers [start, end) on `n` rows after the context: `(1, n, hidden_size)`."""
        mask = causal_mask(n, past, model.dtype, "cpu")
        positions = torch.arange(past, past + n).unsqueeze(0)
        return run_layers(parts, rows(n, start), positions, cache, start, end, mask)

    def check(ld, li, n):
        def run():
            with fast_linears(model):
                exits.logits(li, block(ld, li, n))[0].argmax(-1)
            crop_cache(cache, past)

        return run

    def final(li, n):
        def run():
            with screened_lm_head(model), fast_linears(model):
                parts.lm_head(parts.norm(block(li, depth, n)))[0].float().argmax(-1)
            crop_cache(cache, past)

        return run

    with torch.no_grad(), grouped_attention(model):
        for k in layers:
            costs["step", k] = timed(draft_step(model, cache, context_ids, k, {}, exits), reps)
        costs["step_packed", max(layers)] = timed(
            draft_step(model, cache, context_ids, max(layers), quantized, packed_exits), reps
        )
        for ld, li in itertools.combinations(layers, 2):
            for n in range(1, n_rows + 1):
                costs["check", ld, li, n] = timed(check(ld, li, n), reps)
        for li in layers:
            for n in range(1, 2 * n_rows + 2):
                costs["final", li, n] = timed(final(li, n), reps)
        for n in range(1, n_rows + 2):
            costs["verify", n] = timed(verification(model, cache, context_ids, n), reps)
    return costs


def draft_hits(preds, ld, li, topk=1, rate=None, seed=0):
    """Per text, per position: does the L_d draft pass the L_i check (its top-`topk` holds the L_i exit's token)?
    With `rate`, a coin of that probability instead (what-if exits)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for final, per_layer in preds:
        if rate is not None:
            out.append((torch.rand(len(final), generator=gen) < rate).tolist())
        else:
            top = per_layer[ld][1][:, :topk]
            out.append((top == per_layer[li][0].unsqueeze(1)).any(1).tolist())
    return out


def check_hits(preds, li):
    """Per text, per position: does the L_i exit's token equal the final layer's?"""
    return [(per_layer[li][0] == final).tolist() for final, per_layer in preds]


def replay_hispec(hits, checks, ld, li, nd, ni, costs):
    """(committed tokens, ms, rounds) of HiSpec over all texts, from per-position draft and check outcomes
    (teacher-forced: exact while the chain follows the final layer's tokens; a round ends at the first token it
    does not)."""
    tokens = ms = rounds = 0.0
    for hit, ok in zip(hits, checks, strict=True):
        n_pos = len(hit)
        t0 = 0
        while t0 < n_pos - 1:
            # the root sits at t0; buffered tokens are the L_i exit's predictions at t0, t0 + 1, ...
            p, buffered, first = t0, 0, True
            while buffered < ni and p < n_pos - 1:
                ms += nd * costs["step", ld] + costs["check", ld, li, nd]
                matched = 0
                while matched < nd and hit[min(p + matched, n_pos - 1)]:
                    matched += 1
                keep = min(matched + 1, nd)
                buffered += keep - (1 if first else 0)
                first = False
                p += keep
            buffered = min(buffered, n_pos - 1 - t0)
            accepted = 0
            while accepted < buffered and ok[t0 + accepted]:
                accepted += 1
            ms += costs["final", li, buffered + 1]
            tokens, rounds = tokens + accepted + 1, rounds + 1
            t0 += accepted + 1
    return tokens, ms, rounds


def replay_early_exit(preds, layer, n, costs, packed):
    tokens = ms = rounds = 0.0
    step = costs["step_packed", layer] if packed else costs["step", layer]
    for final, per_layer in preds:
        drafts = per_layer[layer][0]
        t0 = 0
        while t0 < len(final) - 1:
            depth = min(n, len(final) - 1 - t0)
            accepted = 0
            while accepted < depth and drafts[t0 + accepted] == final[t0 + accepted]:
                accepted += 1
            ms += depth * step + costs["verify", depth + 1]
            tokens, rounds = tokens + accepted + 1, rounds + 1
            t0 += accepted + 1
    return tokens, ms, rounds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--exit-heads", default="model_cards/exits-qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--layers", default="4,6,8,12,16,18,20,22")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompts", default="../shared/data/eval/spec_bench_dev.jsonl")
    ap.add_argument("--count", type=int, default=13, help="first prompt of each category, up to this many")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--context", type=int, default=400, help="cached tokens while timing the stages")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--max-nd", type=int, default=4)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="write the result JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.target, dtype=getattr(torch, args.dtype))
    layers = [int(x) for x in args.layers.split(",")]
    exits = load_exit_lm(model, args.exit_heads, draft_vocab=True)
    t = time.perf_counter()
    texts = greedy_continuations(model, tok, args.prompts, args.max_new_tokens, limit=args.count)
    print(f"generated {len(texts)} continuations in {time.perf_counter() - t:.0f} s", flush=True)
    preds = predictions(model, exits, layers, texts, args.topk)
    packed_exits = load_exit_lm(model, args.exit_heads, draft_vocab=True)  # its LM-head rows become int8
    quantized = quantize_draft_layers(decoder_parts(model), max(layers), "int8", packed_exits)
    first = texts[0][1]
    context = torch.cat([first] * (1 + args.context // first.shape[1]), dim=1)[:, : args.context]
    costs = stage_costs(model, exits, packed_exits, layers, context, args.max_nd, args.reps, quantized)
    print("stage ms:", {" ".join(map(str, k)): round(v, 2) for k, v in costs.items()}, flush=True)

    report = analyse(preds, costs, layers, args.max_nd, args.topk)
    if args.out:
        report["args"] = vars(args)
        report["costs"] = {" ".join(map(str, k)): v for k, v in costs.items()}
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


def agreement_rate(pairs) -> float:
    """Share of positions where two prediction tensors agree, over all texts."""
    return round(float(sum(int((a == b).sum()) for a, b in pairs) / sum(len(a) for a, _ in pairs)), 3)


def analyse(preds, costs, layers, max_nd: int, topk: int) -> dict:
    """Replay every configuration; print and return the best ones, agreement rates and the what-if rows."""
    exit_layer = max(layers)
    results = []
    for n, packed in itertools.product(range(1, max_nd + 1), (False, True)):
        tokens, ms, rounds = replay_early_exit(preds, exit_layer, n, costs, packed)
        results.append(
            {"method": "early-exit", "layer": exit_layer, "n": n, "int8": packed,
             "tau": round(tokens / rounds, 2), "ms_per_token": round(ms / tokens, 2)}
        )  # fmt: skip
    grid = list(itertools.product(range(2, max_nd + 1), (1, 2, 3, 4)))  # (N_d, N_i)
    for ld, li in itertools.combinations(layers, 2):
        checks = check_hits(preds, li)
        for k in (1, topk):
            hits = draft_hits(preds, ld, li, k)
            for nd, ni in grid:
                tokens, ms, rounds = replay_hispec(hits, checks, ld, li, nd, ni, costs)
                results.append(
                    {"method": "hispec", "L_d": ld, "L_i": li, "N_d": nd, "N_i": ni, "topk": k,
                     "tau": round(tokens / rounds, 2), "ms_per_token": round(ms / tokens, 2)}
                )  # fmt: skip
    exits = [r for r in results if r["method"] == "early-exit"]
    best_exit = min(exits, key=lambda r: r["ms_per_token"])
    best_exact = min((r for r in exits if not r["int8"]), key=lambda r: r["ms_per_token"])
    print(f"best single exit: {best_exit}\nbest exact-weight exit: {best_exact}")
    best = {}
    for k in (1, topk):
        best[k] = min(
            (r for r in results if r["method"] == "hispec" and r["topk"] == k),
            key=lambda r: r["ms_per_token"],
        )
        print(
            f"best HiSpec, draft top-{k}: {best[k]}: {best_exit['ms_per_token'] / best[k]['ms_per_token']:.2f}x "
            f"the best single exit, {best_exact['ms_per_token'] / best[k]['ms_per_token']:.2f}x the exact-weight one"
        )
    agreement = {f"{a}->{b}": agreement_rate([(p[1][a][0], p[1][b][0]) for p in preds])
                 for a, b in itertools.combinations(layers, 2)}  # fmt: skip
    agreement.update({f"{k}->final": agreement_rate([(p[1][k][0], p[0]) for p in preds]) for k in layers})
    print("top-1 agreement:", agreement)

    # what-if: exits whose L_d draft passes the L_i check with probability `rate` (LayerSkip-like exits)
    what_if = []
    for ld, li in ((4, 22), (8, 22), (12, 22)):
        if ld not in layers or li not in layers:
            continue
        checks = check_hits(preds, li)
        for rate in (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0):
            hits = draft_hits(preds, ld, li, rate=rate)
            runs = [(replay_hispec(hits, checks, ld, li, nd, ni, costs), nd, ni) for nd, ni in grid]
            (tokens, ms, _), nd, ni = min(runs, key=lambda x: x[0][1] / x[0][0])
            what_if.append(
                {"L_d": ld, "L_i": li, "rate": rate, "N_d": nd, "N_i": ni, "ms_per_token": round(ms / tokens, 2),
                 "vs_best_exit": round(best_exit["ms_per_token"] * tokens / ms, 3)}
            )  # fmt: skip
            print("what-if", what_if[-1])
    return {"best_exit": best_exit, "best_exact_exit": best_exact, "best_hispec": best, "agreement": agreement,
            "what_if": what_if, "results": results}  # fmt: skip


if __name__ == "__main__":
    main()
