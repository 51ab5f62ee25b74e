#!/usr/bin/env bash
# A/B of a kernel change in one device run: the pipeline probe from a base checkout (a
# copy of the tree at the commit to compare against) and from this one, alternating,
# ROUNDS times each, so that drift of the card over the run hits both alike.
#
#   scripts/ab_probe.sh BASE_DIR [pipeline_probe.py options, e.g. --only "as compiled" --idle 2]
#
# Make BASE_DIR with `git worktree add BASE_DIR <commit>` and take it along to the GPU
# machine. ROUNDS (default 2) sets the alternations. Prints the probe's timing lines.
set -uo pipefail
base=${1:?usage: scripts/ab_probe.sh BASE_DIR [probe options]}
shift
here=$(cd "$(dirname "$0")/.." && pwd)
base=$(cd "$base" && pwd)
site=${GEMMSPEC_SITE:-}
for round in $(seq "${ROUNDS:-2}"); do
  for side in base new; do
    dir=$([ "$side" = base ] && echo "$base" || echo "$here")
    echo "== $side (round $round)"
    (cd "$dir" && PYTHONPATH="${site:+$site:}$dir" timeout 240 python3 scripts/pipeline_probe.py "$@" 2>&1 | grep -E "TFLOPS|TB/s| us |skipped|Error")
  done
done
