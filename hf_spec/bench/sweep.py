"""`hf-spec sweep hispec`: HiSpec throughput over the (L_d, L_i) grid (paper Figure 8) and over N_d and N_i at the
best pair (paper Figure 7), every configuration run side by side with `ar` on the same prompts.

Per configuration: tokens/s, speedup (its mean tokens/s over `ar`'s), tau, and the share of rejected draft tokens
that the intermediate verification caught (`rejected_early / (rejected_early + rejected_full)`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from hf_spec.bench.runner import ForwardCounter, Method, Prompt, encode_chat, machine_info
from hf_spec.methods.hispec.config import HiSpecConfig


def config_label(cfg: HiSpecConfig) -> str:
    return f"d{cfg.draft_layer}-i{cfg.verify_layer}-nd{cfg.num_draft_tokens}-ni{cfg.num_buffer_tokens}"


def measure_configs(
    model,
    tokenizer,
    configs: list[HiSpecConfig],
    prompts: list[Prompt],
    max_new_tokens: int,
    config_dir: Path,
    progress: Callable | None = None,
) -> dict:
    """Run `ar` then every config on each prompt (first turn), interleaved; greedy outputs are checked
    against `ar`'s. Returns `{"ar": row, label: row, ...}` of summed counters and mean speeds."""
    config_dir.mkdir(parents=True, exist_ok=True)
    methods = {"ar": Method("ar", model, tokenizer, max_new_tokens)}
    for cfg in configs:
        path = config_dir / f"hispec-{config_label(cfg)}.json"
        path.write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
        methods[config_label(cfg)] = Method(f"hispec:{path}", model, tokenizer, max_new_tokens)
    counter = ForwardCounter(model)
    rows: dict[str, dict] = {name: {"tps": [], "tau": [], "counts": {}, "mismatches": 0} for name in methods}
    bar = progress(total=len(prompts) * len(methods)) if progress else None
    try:
        warm = encode_chat(tokenizer, [{"role": "user", "content": prompts[0].turns[0]}])
        for m in methods.values():  # one short warm-up call each
            m.kwargs["max_new_tokens"], saved = 8, m.kwargs["max_new_tokens"]
            m.generate(warm, None, counter)
            m.kwargs["max_new_tokens"] = saved
        for p in prompts:
            ids = encode_chat(tokenizer, [{"role": "user", "content": p.turns[0]}])
            ref = None
            for name, m in methods.items():
                out, row = m.generate(ids, None, counter)
                rows[name]["tps"].append(row["tokens_per_s"])
                rows[name]["tau"].append(row["tau"])
                if name == "ar":
                    ref = out
                else:
                    rows[name]["mismatches"] += int(not torch.equal(out, ref))
                    for k, v in m.decoder.drafter_for(model).counts.items():
                        rows[name]["counts"][k] = rows[name]["counts"].get(k, 0) + v
                if bar:
                    bar.update(1)
    finally:
        counter.close()
        if bar:
            bar.close()
    ar_tps = sum(rows["ar"]["tps"]) / len(prompts)
    summary = {}
    for name, r in rows.items():
        tps = sum(r["tps"]) / len(prompts)
        c = r["counts"]
        rejected = c.get("rejected_early", 0) + c.get("rejected_full", 0)
        summary[name] = {
            "tokens_per_s": tps,
            "speedup_vs_ar": tps / ar_tps,
            "tau": sum(r["tau"]) / len(prompts),
            "mismatches": r["mismatches"],
            "counts": c,
            "rejected_early_share": c.get("rejected_early", 0) / rejected if rejected else None,
            "early_rejections_per_draft": c.get("rejected_early", 0) / c["drafted"]
            if c.get("drafted")
            else None,
        }
    return summary


def best_config(configs: list[HiSpecConfig], summary: dict) -> HiSpecConfig:
    return max(configs, key=lambda c: summary[config_label(c)]["speedup_vs_ar"])


def plot_heatmap(configs: list[HiSpecConfig], summary: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ds = sorted({c.draft_layer for c in configs})
    vs = sorted({c.verify_layer for c in configs})
    grid = torch.full((len(ds), len(vs)), float("nan"))
    for c in configs:
        grid[ds.index(c.draft_layer), vs.index(c.verify_layer)] = summary[config_label(c)]["speedup_vs_ar"]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.5 + 0.8 * len(vs)), 1.5 + 0.6 * len(ds)))
    im = ax.imshow(grid.numpy(), cmap="viridis", origin="lower", aspect="auto")
    for i in range(len(ds)):
        for j in range(len(vs)):
            if not torch.isnan(grid[i, j]):
                ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", color="white", fontsize=8)
    ax.set_xticks(range(len(vs)), [str(v) for v in vs])
    ax.set_yticks(range(len(ds)), [str(d) for d in ds])
    ax.set_xlabel("L_i (intermediate verification layer)")
    ax.set_ylabel("L_d (draft layer)")
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label="speedup vs ar")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_lines(series: dict[str, list[tuple[int, float]]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(series), figsize=(4 * len(series), 3.2), squeeze=False)
    for ax, (name, points) in zip(axes[0], series.items(), strict=True):
        ax.plot([x for x, _ in points], [y for _, y in points], marker="o")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xlabel(name)
        ax.set_ylabel("speedup vs ar")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_sweep(out: Path, result: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    result["machine"] = machine_info()
    (out / "sweep.json").write_text(json.dumps(result, indent=2, default=float) + "\n")
    lines = [
        "| config | speedup | tok/s | tau | rejected early (share of rejections) | greedy mismatches |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in result["summary"].items():
        share = s["rejected_early_share"]
        lines.append(
            f"| `{name}` | {s['speedup_vs_ar']:.2f}x | {s['tokens_per_s']:.1f} | {s['tau']:.2f} | "
            f"{'-' if share is None else f'{share:.2f}'} | {'-' if name.startswith('ar') else s['mismatches']} |"
        )
    m = result["machine"]
    lines += [
        "",
        f"Best: `{result['best']}`",
        "",
        f"Command: `{result['command']}`",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['torch_threads']} torch threads; torch {m['torch']}, "
        f"transformers {m['transformers']}; {m['date']}",
    ]
    (out / "sweep.md").write_text("\n".join(lines) + "\n")
