#!/usr/bin/env bash
# Compare two commits of hf-spec with the same `hf-spec bench` arguments: each commit's methods against its own
# `ar` in its own run, the two runs back to back on this machine, then one table of both columns.
#
#   bash benchmarks/ab_commits.sh BASE_REV OUT_DIR -- <hf-spec bench arguments without --out>
#
# BASE_REV is checked out as a git worktree next to this checkout (../hf-spec-base-<rev>) and imported through
# PYTHONPATH with this checkout's .venv, so both runs share one Python, torch and transformers. Relative paths in
# the bench arguments (configs, prompts, ../shared) resolve in each checkout, as they would for a user there.
# Writes OUT_DIR/base and OUT_DIR/new (each a bench output folder) and OUT_DIR/ab.md. The base runs first;
# AB_ORDER=new-first runs the working tree first (run both orders to see the drift between two runs).
set -euo pipefail
cd "$(dirname "$0")/.."
base_rev=$1 out=$2
shift 2
[ "${1:-}" = "--" ] && shift
[ -e "$out" ] && { echo "$out exists: pick a new output folder" >&2; exit 2; }
here=$(pwd)
python=$here/.venv/bin/python
base_dir=$(cd .. && pwd)/hf-spec-base-$(git rev-parse --short "$base_rev")
[ -d "$base_dir" ] || git worktree add --detach "$base_dir" "$base_rev" >/dev/null
mkdir -p "$out"
out=$(cd "$out" && pwd)
run_base() {
  echo "== base $(git -C "$base_dir" rev-parse --short HEAD) in $base_dir"
  (cd "$base_dir" && PYTHONPATH="$base_dir" "$python" -m hf_spec.cli.main bench "$@" --out "$out/base")
}
run_new() {
  echo "== new $(git rev-parse --short HEAD) (+ working tree) in $here"
  (cd "$here" && PYTHONPATH="$here" "$python" -m hf_spec.cli.main bench "$@" --out "$out/new")
}
if [ "${AB_ORDER:-base-first}" = new-first ]; then
  run_new "$@"
  run_base "$@"
else
  run_base "$@"
  run_new "$@"
fi
"$python" - "$out" <<'EOF'
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
runs = {side: json.loads((out / side / "results.json").read_text()) for side in ("base", "new")}
rows = ["| method | base: x ar | new: x ar | new / base | base tau | new tau |", "|---|---|---|---|---|---|"]
for method, new in runs["new"]["summary"].items():
    base = runs["base"]["summary"].get(method)
    if base is None:
        continue
    ratio = new["speedup_vs_ar"] / base["speedup_vs_ar"]
    rows.append(
        f"| {method} | {base['speedup_vs_ar']:.3f} | {new['speedup_vs_ar']:.3f} | {ratio:.3f} | "
        f"{base['tau']:.2f} | {new['tau']:.2f} |"
    )
machine = runs["new"]["machine"]
text = "\n".join(rows) + (
    f"\n\n{machine['cpu']}, {machine['cores']} cores, {machine.get('dtype')}, {machine['date']}; "
    f"command: {runs['new']['command']}\n"
)
(out / "ab.md").write_text(text)
print(text)
EOF
