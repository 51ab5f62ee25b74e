#!/usr/bin/env bash
# Build gemmspec's emitted CUDA into a plain C++ program with nvcc and run it on a
# Hopper GPU: compiles moe_fp8_forward and linear_fp8_training into one folder, builds
# every .cu with warnings as errors, links examples/cpp/embed_check.cpp against them,
# runs it (it checks every output against its own CPU reference) and prints PASS/FAIL.
# moe_fp8_forward runs at a T above the threshold of its decode variant and at one below
# it, so the host launcher's both programs (`*_launch0.cu` and `*_launch0_decode.cu`,
# both built by the glob below) are checked.
#
#   bash scripts/cpp_embed_check.sh          # logs and binaries under $OUT (default out/cpp_embed)
#   NVCC=/usr/local/cuda/bin/nvcc PYTHON=.venv/bin/python bash scripts/cpp_embed_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-out/cpp_embed}
NVCC=${NVCC:-nvcc}
PYTHON=${PYTHON:-python}
ARCH="-gencode=arch=compute_90a,code=sm_90a"
FLAGS=(-std=c++17 -O2 -Werror all-warnings -Xcompiler -Wall,-Wextra,-Werror)
GEN="$OUT/gen"

rm -rf "$GEN" "$OUT/obj"
mkdir -p "$GEN" "$OUT/obj"
for spec in moe_fp8_forward linear_fp8_training; do
  "$PYTHON" -m gemmspec compile "examples/$spec.gspec" -o "$GEN" > /dev/null
done
"$NVCC" --version | tail -1

# Every emitted file, in parallel; any failure fails the script.
pids=()
objs=()
for src in "$GEN"/*.cu; do
  obj="$OUT/obj/$(basename "$src").o"
  "$NVCC" $ARCH "${FLAGS[@]}" -I"$GEN" -c "$src" -o "$obj" &
  pids+=($!)
  objs+=("$obj")
done
for pid in "${pids[@]}"; do wait "$pid"; done

"$NVCC" "${FLAGS[@]}" -I"$GEN" -c examples/cpp/embed_check.cpp -o "$OUT/obj/embed_check.o"
"$NVCC" $ARCH "${objs[@]}" "$OUT/obj/embed_check.o" -o "$OUT/embed_check"

set +e
"$OUT/embed_check" | tee "$OUT/embed_check.log"
status=${PIPESTATUS[0]}
set -e
echo "cpp_embed_check: exit $status (log: $OUT/embed_check.log)"
exit "$status"
