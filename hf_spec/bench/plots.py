"""Plots of a benchmark run (`results.json` of `hf-spec bench`): `speedup.png` (speedup over `ar` per Spec-Bench
group and overall, the spread across prompts as points, tokens/s beside each overall ratio) and `acceptance.png`
(tau and draft utilisation per method, with the same spread). matplotlib is imported only when a plot is drawn.
"""

from __future__ import annotations

import shlex
from collections import defaultdict
from pathlib import Path

from hf_spec.bench.prompts import spec_bench_group


def run_target(results: dict) -> str | None:
    """The `--target` of the run's command (its last path component), or None when the command does not say."""
    words = shlex.split(results.get("command", ""))
    for flag, value in zip(words, words[1:], strict=False):
        if flag == "--target":
            return Path(value).name
    return None


def short_label(method: str, target: str | None = None) -> str:
    """A method's name for plots and tables: the config's name for `name:path/to/config.json` (its file name without
    `.json` and without the target's name), the folder's name for `name:path/to/folder`, else the spec itself.

    Example: `short_label("retrieval:benchmarks/configs/retrieval-qwen2.5-coder-0.5b-instruct-long.json",
    "qwen2.5-coder-0.5b-instruct")` -> `"retrieval-long"`; a `+compiled` suffix stays (`"retrieval-long+compiled"`).
    """
    compiled = "+compiled" if method.endswith("+compiled") else ""
    name, _, arg = method.removesuffix(compiled).partition(":")
    if "/" not in arg and not arg.endswith(".json"):
        return method
    stem = Path(arg).name.removesuffix(".json")
    if target:
        stem = stem.replace(f"-{target}", "").replace(target, "").strip("-")
    return (stem or name) + compiled


def per_prompt(results: dict, key: str) -> dict[str, list[float]]:
    """Per method, one value a prompt: `key` = "speedup" (tokens/s over `ar`'s on the same prompt and turn),
    or a field of the run rows ("tau", "draft_utilization", "tokens_per_s")."""
    runs = results.get("runs", [])
    ar = {(r["question_id"], r["turn"]): r["tokens_per_s"] for r in runs if r["method"] == "ar"}
    out: dict[str, list[float]] = defaultdict(list)
    for r in runs:
        if key == "speedup":
            base = ar.get((r["question_id"], r["turn"]))
            if base:
                out[r["method"]].append(r["tokens_per_s"] / base)
        elif r.get(key) is not None:
            out[r["method"]].append(float(r[key]))
    return out


def per_prompt_by_group(results: dict) -> dict[str, dict[str, list[float]]]:
    """Per method and Spec-Bench group, the per-prompt speedups over `ar`."""
    runs = results.get("runs", [])
    ar = {(r["question_id"], r["turn"]): r["tokens_per_s"] for r in runs if r["method"] == "ar"}
    out: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in runs:
        base = ar.get((r["question_id"], r["turn"]))
        if base:
            out[r["method"]][spec_bench_group(r["category"])].append(r["tokens_per_s"] / base)
    return out


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _title(results: dict) -> str:
    m = results.get("machine", {})
    target = run_target(results) or "target"
    return (
        f"{target}, {m.get('dtype', 'float32')}: {m.get('cpu', '?')}, {m.get('torch_threads', '?')} threads"
    )


def plot_speedups(results: dict, path: str | Path) -> None:
    """`speedup.png`: a bar per method and Spec-Bench group (mean speedup over `ar`, as the bench scores it) and
    overall, each prompt as a point on its bar; the legend (outside the axes) gives each method's overall speedup
    and tokens/s."""
    plt = _pyplot()
    target = run_target(results)
    summary = {k: v for k, v in results["summary"].items() if k != "ar"}
    groups = sorted({g for e in summary.values() for g in e["per_group"]}) + ["overall"]
    spread = per_prompt_by_group(results)
    overall = per_prompt(results, "speedup")
    width = 0.8 / max(len(summary), 1)
    fig, ax = plt.subplots(figsize=(max(7.0, 1.3 * len(groups) + 3.5), 4.2))
    palette = plt.get_cmap("tab20" if len(summary) > 10 else "tab10")  # tab10 repeats after ten methods
    for i, (name, e) in enumerate(summary.items()):
        xs = [j + (i - (len(summary) - 1) / 2) * width for j in range(len(groups))]
        vals = [e["per_group"].get(g, 0.0) for g in groups[:-1]] + [e["speedup_vs_ar"]]
        label = f"{short_label(name, target)}: {e['speedup_vs_ar']:.2f}x, {e['tokens_per_s']:.1f} tok/s"
        ax.bar(xs, vals, width, label=label, color=palette(i % palette.N))
        points = [spread[name].get(g, []) for g in groups[:-1]] + [overall.get(name, [])]
        for x, ys in zip(xs, points, strict=True):
            ax.scatter([x] * len(ys), ys, s=7, color="black", alpha=0.55, zorder=3, linewidths=0)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(groups)), groups, rotation=20)
    ax.set_ylabel("speedup over plain generate (ar)")
    ax.set_title(_title(results), fontsize=9)
    ax.legend(
        fontsize=8,
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        borderaxespad=0.0,
        title="mean; points: prompts",
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def plot_acceptance(results: dict, path: str | Path) -> None:
    """`acceptance.png`: tau (tokens committed per target forward) and draft utilisation (accepted / proposed draft
    tokens) per method, each prompt as a point on its bar."""
    plt = _pyplot()
    target = run_target(results)
    summary = {k: v for k, v in results["summary"].items() if k != "ar"}
    names = list(summary)
    labels = [short_label(n, target) for n in names]
    fig, axes = plt.subplots(1, 2, figsize=(10.0, 0.45 * len(names) + 1.6), sharey=True)
    for ax, key, title in (
        (axes[0], "tau", "tau: tokens per target forward"),
        (axes[1], "draft_utilization", "draft utilisation: accepted / proposed"),
    ):
        spread = per_prompt(results, key)
        means = [summary[n].get(key) for n in names]
        ys = range(len(names))
        ax.barh(ys, [m if m is not None else 0.0 for m in means], color="tab:blue", alpha=0.7)
        for y, n, m in zip(ys, names, means, strict=True):
            pts = spread.get(n, [])
            ax.scatter(pts, [y] * len(pts), s=7, color="black", alpha=0.55, zorder=3, linewidths=0)
            text = "-" if m is None else f"{m:.2f}"
            ax.annotate(text, (0.0, y), xytext=(3, -3), textcoords="offset points", fontsize=8, color="white")
        ax.set_title(title, fontsize=9)
        ax.set_yticks(list(ys), labels)
    axes[0].invert_yaxis()  # shared: methods top to bottom in the run's order
    axes[0].axvline(1.0, color="black", linewidth=0.8)
    fig.suptitle(_title(results) + "  (points: prompts)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def write_plots(results: dict, out_dir: str | Path) -> list[Path]:
    """Both plots into `out_dir`; returns their paths."""
    out = Path(out_dir)
    paths = [out / "speedup.png", out / "acceptance.png"]
    plot_speedups(results, paths[0])
    plot_acceptance(results, paths[1])
    return paths


__all__ = [
    "per_prompt",
    "per_prompt_by_group",
    "plot_acceptance",
    "plot_speedups",
    "run_target",
    "short_label",
    "write_plots",
]
