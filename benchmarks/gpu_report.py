"""The GPU check's report as markdown (`benchmarks/gpu_check.py` writes it next to `gpu_check.json`)."""

from __future__ import annotations

from pathlib import Path

PAPER_CLAIMS = {  # `hf_spec.bench.rounds.paper_ratios` keys: the claim and the ratio its paper measured on GPUs
    "lyanna_vs_hass": ("Lyanna / the HASS head", 1.2),
    "hispec_vs_best_exit": ("HiSpec / the best single exit", 1.25),
    "talon_vs_better_half": ("Talon's hybrid / its better half", 1.1),
}


def markdown(report: dict) -> str:
    """The report as markdown tables, one section a shape."""
    lines = [f"# GPU check: {report['device']}", "", f"torch {report['torch']}, dtype {report['dtype']}", ""]
    for r in report["shapes"]:
        lines += [f"## {r['shape']} ({r['params_b']:.2f}B parameters, random weights)", ""]
        lines += [f"plain `generate`: {r['plain_tokens_per_s']:.1f} tokens/s", ""]
        lines += _compiled_generate(r.get("compiled_generate"))
        if "verify_relative" in r:
            lines += ["| tree nodes | " + " | ".join(map(str, r["verify_relative"])) + " |",
                      "|---|" + "---|" * len(r["verify_relative"]),
                      "| cost / one step | " + " | ".join(f"{v:.2f}" for v in r["verify_relative"].values()) + " |",
                      ""]  # fmt: skip
        lines += _static_curve(r.get("verify_static"))
        failed = [k for k, v in r.items() if isinstance(v, dict) and "error" in v]
        lines += [
            f"{k}: failed ({r[k]['error']})"
            for k in failed
            if k not in ("compiled_generate", "verify_static")
        ]
        r = {k: v for k, v in r.items() if k not in failed}
        lines += _backends(r.get("backends", {}))
        if "kernels" in r:
            lines += [
                "",
                "| kernel | Triton ms | torch twin ms | speedup | max error |",
                "|---|---|---|---|---|",
            ]
            lines += [f"| {k} | {v['kernel_ms']:.3f} | {v['torch_ms']:.3f} | {v['speedup']:.2f}x | {v['max_error']:.2g} |"
                      for k, v in r["kernels"].items()]  # fmt: skip
        for file, rep in r.get("replay", {}).items():
            lines += _replay(file, rep, "plain `generate`")
        for file, rep in r.get("replay_compiled", {}).items():
            lines += _replay(file, rep, "compiled `generate`, at the compiled verification costs")
        lines += _speculative(r.get("compiled_speculative"))
        if r.get("skipped"):
            lines += ["", "Skipped (time budget): " + ", ".join(r["skipped"])]
        phases = ", ".join(f"{k} {v:.0f} s" for k, v in r.get("phase_seconds", {}).items())
        lines += ["", f"Phases: {phases}" if phases else "", ""]
    return "\n".join(lines)


def _compiled_generate(c: dict | None) -> list[str]:
    if not c:
        return []
    if "error" in c:
        return [f"compiled `generate`: failed ({c['error']})", ""]
    same = (
        "same tokens as eager"
        if c["same_tokens_as_eager"]
        else f"differs from eager at token {c['first_difference']}"
    )
    return [f"compiled `generate` (static cache, `{c['mode']}`): {c['tokens_per_s']:.1f} tokens/s "
            f"({same}; first call, compiling: {c['first_call_s']:.0f} s)", ""]  # fmt: skip


def _static_curve(s: dict | None) -> list[str]:
    if not s:
        return []
    if "error" in s:
        return [f"static-cache verification curve: failed ({s['error']})", ""]
    widths = list(s["eager"])
    lines = [
        "| rows verified (static cache) | " + " | ".join(map(str, widths)) + " |",
        "|---|" + "---|" * len(widths),
    ]
    for kind in ("eager", "compiled"):
        cells = [f"{1e3 * s[kind][w]:.2f}" if w in s[kind] else "skipped" for w in widths]
        lines.append(f"| {kind} ms | " + " | ".join(cells) + " |")
    compiled = s["compiled"]
    if compiled and widths[0] in compiled:
        cells = [f"{compiled[w] / compiled[widths[0]]:.2f}" if w in compiled else "" for w in widths]
        lines.append("| compiled cost / one step | " + " | ".join(cells) + " |")
    return [*lines, ""]


def _backends(backends: dict) -> list[str]:
    if not backends:
        return []
    lines = ["| backend | loop ms/round | share of a 9-token verification | syncs/round | oracle:k speedup |",
             "|---|---|---|---|---|"]  # fmt: skip
    for name, b in backends.items():
        ks = ", ".join(f"{k}: {s:.2f}x" for k, s in b["oracle_speedup"].items())
        lines.append(f"| {name} | {b['loop_ms_per_round']:.3f} | {b['loop_share_of_verification']:.1%} | "
                     f"{b['syncs_per_round']:.2f} | {ks} |")  # fmt: skip
    return lines


def _replay(file: str, rep: dict, baseline: str) -> list[str]:
    from hf_spec.bench.plots import short_label

    where = rep["recorded_machine"].get("cpu", "")
    lines = ["", f"Replay of `{file}` against {baseline} (rounds of {rep['recorded_on']}, recorded on "
             f"{where or 'a CPU'}):", "", "| method | tau | speedup at these costs |", "|---|---|---|"]  # fmt: skip
    target = Path(rep["recorded_on"]).name
    for name, m in rep["methods"].items():
        speed = f"{m['speedup']:.2f}x" if m["speedup"] else "n/a"
        lines.append(f"| {short_label(name, target)} | {m['tau'] or 0:.2f} | {speed} |")
    lines += ["", "| paper claim | measured there | ratio here |", "|---|---|---|"]
    lines += [f"| {PAPER_CLAIMS[k][0]} | >= {PAPER_CLAIMS[k][1]}x | {f'{v:.2f}x' if v else 'n/a'} |"
              for k, v in rep["ratios"].items()]  # fmt: skip
    return lines


def _speculative(s: dict | None) -> list[str]:
    if not s:
        return []
    if not s.get("available"):
        return ["", f"compiled speculative decoding (`--compile`): not available ({s.get('reason', '')})"]
    ks = ", ".join(f"{k}: {x:.2f}x" + ("" if s["same_tokens"][k] else " (tokens differ)")
                   for k, x in s["oracle_speedup"].items())  # fmt: skip
    return ["", f"compiled speculative decoding against compiled `generate`, `oracle:k`: {ks}"]
