#!/usr/bin/env bash
# 64-row decode tiles (the decode variant: 64 x 256, two column warpgroups) against 128-row
# tiles (128 x 256, two row warpgroups: an expert's weights read once for up to 128 rows),
# timed in one process each (pipeline_probe.py --idle 150), on a Hopper GPU, one part per run:
#
#   shapes  E32's token counts (22 experts of 1-129 rows) at N 4096 and 7168, K 2048, 4096, 7168
#   counts  32 experts of M rows each, M = 16, 32, 48, 64, 96, 128, at N 4096, K 7168
#
#   scripts/tile_rows_sweep.sh PART [OUT_DIR]     (the log goes to OUT_DIR/PART.log; default tile_rows)
#
# A rule choosing 128-row tiles by T, N and K needs both parts: at version 3.30 they paid
# on E32 N4096 K7168 alone. Every command has its own timeout.
set -uo pipefail
part=${1:?usage: scripts/tile_rows_sweep.sh shapes|counts [OUT_DIR]}
out=${2:-tile_rows}
here=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
only="128 x 256 (two row warpgroups)|(again"
probe() {
  echo "== pipeline_probe.py $*"
  PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" timeout 90 python3 "$here/scripts/pipeline_probe.py" --idle 150 \
    --only "$only" "$@" 2>&1 | grep --line-buffered -E "TB/s|skipped|Error|selects"
}
case "$part" in
  shapes)
    for n in 4096 7168; do
      for k in 2048 4096 7168; do probe --decode e32 --shape "32,32,$n,$k"; done
    done > "$out/$part.log" 2>&1
    ;;
  counts)
    for m in 16 32 48 64 96 128; do probe --decode uniform --shape "32,$m,4096,7168"; done > "$out/$part.log" 2>&1
    ;;
  *)
    echo "unknown part '$part' (shapes or counts)" >&2
    exit 2
    ;;
esac
cat "$out/$part.log"
