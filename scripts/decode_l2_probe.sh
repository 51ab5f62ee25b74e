#!/usr/bin/env bash
# The decode kernels' options (where the weights go in L2, when a CTA leaves), measured on
# a Hopper GPU, one part per run:
#
#   floor   every decode row's weights streamed alone (decode_stream_floor.cu), their loads
#           with no L2 policy, evicting first, and evicting first beside A's evicting last;
#           each with no consumer and with an 850-cycle one (back to back, after the
#           bench's dirtying memset, after a read of as many bytes)
#   fp8     the FP8 decode variant against the same kernel with the options (pipeline_probe.py:
#           weights evicting first, the first unit asked of L2 ahead, CTAs leaving once their
#           last stores have read the staging, 128-row tiles), one launch per 150 ms idle
#           gap: E8 and E32 N4096
#   fp8_more  the same for E32 N7168 and Qwen3's FP8 down projection
#   masked  the masked rows the same way
#   bf16    Qwen3's BF16 rows the same way
#   ffn     the decode expert FFN in one spec (DeepSeek-V3 T64 and T512, Qwen3 T128) with its
#           launches under the options (ffn_decode_probe.py, graph replays, idle gaps)
#
#   scripts/decode_l2_probe.sh PART [OUT_DIR]     (logs go to OUT_DIR/PART.log; default l2_probe)
#
# Every command has its own timeout. PYTHONPATH must reach gemmspec's Python dependencies.
set -uo pipefail
part=${1:?usage: scripts/decode_l2_probe.sh floor|fp8|fp8_more|masked|bf16|ffn [OUT_DIR]}
out=${2:-l2_probe}
here=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
log="$out/$part.log"

# The probe's variants that name an L2 option or the 128-row tile, then the variant again.
only="evict first,ahead,leave on,128 x 256,whole tiles (no split K),(again"
probe() {
  echo "== pipeline_probe.py $*"
  PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" timeout 280 python3 "$here/scripts/pipeline_probe.py" --idle 150 "$@" 2>&1 |
    grep -E "TB/s|skipped|Error"
}

case "$part" in
  floor)
    nvcc -O2 -arch=sm_90a -std=c++17 -o "$out/decode_stream_floor" "$here/scripts/decode_stream_floor.cu" || exit 1
    # Each row's weights (E,N,K in bytes: BF16 rows at twice their K) and, where an expert
    # has more than 64 rows, its row tiles.
    rows=(
      "5,4096,7168"                                                      # E8 T128
      "22,4096,7168 rows=1,1,1,1,1,1,1,1,1,1,1,2,2,1,1,2,2,1,1,3,1,1"    # E32 T1024 N4096
      "22,7168,2048 rows=1,1,1,1,1,1,1,1,1,1,1,2,2,1,1,2,2,1,1,3,1,1"    # E32 T1024 N7168
      "32,4096,7168" "32,7168,2048"                                      # masked E32 x M64
      "80,2048,768" "128,2048,768" "80,1536,2048"                        # Qwen3 FP8: T16 down, T128/T512 down, T16 gate/up
      "80,2048,1536" "128,1536,4096"                                     # Qwen3 BF16: T16 down, T512 gate/up
    )
    for hints in none,none first,none first,last; do
      for row in "${rows[@]}"; do
        echo "== $row hints=$hints"
        # shellcheck disable=SC2086  # a row is its arguments
        timeout 120 "$out/decode_stream_floor" $row "hints=$hints" 256 4 1 0 256 4 1 850
      done
    done > "$log" 2>&1
    ;;
  fp8)
    {
      probe --decode e8 --shape 8,16,4096,7168 --only "$only"
      probe --decode e32 --shape 32,32,4096,7168 --only "$only"
    } > "$log" 2>&1
    ;;
  fp8_more)
    {
      probe --decode e32 --shape 32,32,7168,2048 --only "$only"
      probe --decode qwen3 --shape 128,8,2048,768 --only "$only"
    } > "$log" 2>&1
    ;;
  masked)
    {
      probe --masked --shape 32,64,4096,7168 --only "evict first,ahead,leave on,as compiled"
      probe --masked --shape 32,64,7168,2048 --only "evict first,ahead,leave on,as compiled"
    } > "$log" 2>&1
    ;;
  bf16)
    {
      probe --bf16 --decode qwen3_t16 --shape 128,1,2048,768 --only "$only"
      probe --bf16 --decode qwen3_t512 --shape 128,32,1536,2048 --only "$only"
    } > "$log" 2>&1
    ;;
  ffn)
    for case in dsv3_T64 dsv3_T512 qwen3_T128; do
      echo "== ffn_decode_probe.py --case $case"
      PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" timeout 280 python3 "$here/scripts/ffn_decode_probe.py" --case "$case" 2>&1 |
        grep -E "TB/s|Error|BITS"
    done > "$log" 2>&1
    ;;
  *)
    echo "unknown part '$part' (floor, fp8, fp8_more, masked, bf16 or ffn)" >&2
    exit 2
    ;;
esac
cat "$log"
