#!/usr/bin/env bash
# Everything that needs the H200, in one go: a smoke run, kernel-variant probes, the GPU
# tests, the sanitizer suite and the benchmark table. Run from the repository root on a Hopper
# machine. Logs go to $OUT (or ./out). STEPS picks a subset, e.g. STEPS=smoke,probe,bench
# (steps: smoke, probe, tests, sanitizer, racecheck, stress, cpp, bench, decode_profile, ncu,
# tile_rows).
# Every step has a time limit, so a hung kernel costs minutes, not the whole session.
set -uo pipefail
OUT=${OUT:-out}
STEPS=${STEPS:-smoke,tests,sanitizer,bench}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ! python3 -c "import lark" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/gs-site .whl/*.whl && export PYTHONPATH=/tmp/gs-site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
export GEMMSPEC_CACHE_DIR=${GEMMSPEC_CACHE_DIR:-/tmp/gemmspec-cache}
want() { [[ ",$STEPS," == *",$1,"* ]]; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv | tee "$OUT/gpu.txt"
status=0
if want smoke; then
  timeout 180 python3 -m gemmspec run examples/moe_fp8_forward.gspec --dims T=8192 --repeats 3 2>&1 | tee "$OUT/smoke.log"
  rc=${PIPESTATUS[0]}
  if [ "$rc" -eq 124 ]; then echo "smoke run timed out: a kernel hangs; stopping here"; exit 1; fi
  [ "$rc" -eq 0 ] || status=1
fi
if want probe; then
  # Kernel variants of the FP8 headline (tile width, CTA pairs, epilogue, promotion).
  timeout 240 python3 scripts/pipeline_probe.py ${PROBE_ARGS:-} 2>&1 | tee "$OUT/probe.log" || status=1
fi
if want tests; then
  # The element-wise checks compute a float64 reference of every element: spread the
  # suite over the machine's cores (pytest-xdist).
  timeout 480 python3 -m pytest -q -m gpu tests/gpu -rs -p no:cacheprovider -n ${GPU_TEST_WORKERS:-12} 2>&1 | tee "$OUT/gpu_tests.log" || status=1
fi
if want sanitizer; then
  # API errors are off: cuda.core probes each kernel's parameters with cuKernelGetParamInfo
  # until it answers INVALID_VALUE, which is how the parameter count is found.
  timeout 420 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 --log-file "$OUT/sanitizer_full.log" \
    python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider \
    -k "bad_offsets or nested and 1-1 or single_expert or linear_fp8_training or wgrad_counts or padded_wgrad and 576 and up or requantize_into_padded or pipeline_64 or row_edges and 576 or swiglu and 200 or rowwise and 200 or capture_survives or decode_variant and (small or edges_low) or halves and (sep_fp8_f256_k256 or stk_fp8_out) or ffn_decode and random_data" 2>&1 | tail -5 | tee "$OUT/sanitizer.log" || status=1
  grep -v "Host Frame" "$OUT/sanitizer_full.log" | head -40
fi
if want racecheck; then
  # Shared-memory races (the staged epilogue, the producer's copies by hand) on a few
  # launches that take every path: ragged edges, f32 reduce-add, unaligned operands.
  timeout 420 compute-sanitizer --tool racecheck --racecheck-report all --error-exitcode 9 --log-file "$OUT/racecheck_full.log" \
    python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider \
    -k "wgrad_counts or pipeline_row_edges and 576 and fp8 or scaled_wide_tiles and 192 and 100" 2>&1 | tail -5 | tee "$OUT/racecheck.log" || status=1
  grep -v "Host Frame" "$OUT/racecheck_full.log" | tail -20
fi
if want stress; then
  # GPU tests started together (STRESS_COPIES processes on one GPU), so that their kernels
  # interleave: a result that depends on timing shows here as a run that fails among
  # passing ones. The decode FFN's graph replay and the decode variant's graph tests.
  # 10 by default: each copy of the decode FFN's test holds about 11.7 GB (DeepSeek-V3's
  # 256 experts' weights), and 12 copies ran out of the H200's memory.
  copies=${STRESS_COPIES:-10}
  for i in $(seq "$copies"); do
    timeout 240 python3 -m pytest -q -m gpu tests/gpu/test_ffn_decode_gpu.py tests/gpu/test_decode_variant_gpu.py \
      -p no:cacheprovider -k "${STRESS_K:-graph}" > "$OUT/stress_$i.log" 2>&1 &
  done
  wait
  tail -qn1 "$OUT"/stress_*.log | sort | uniq -c | tee "$OUT/stress.log"
  grep -h -A12 "^E   " "$OUT"/stress_*.log | head -60 | tee -a "$OUT/stress.log"
  grep -q failed "$OUT/stress.log" && status=1
fi
if want cpp; then
  # The emitted files built into a plain C++ program with nvcc, run and checked.
  timeout 300 env OUT="$OUT/cpp_embed" PYTHON=python3 bash scripts/cpp_embed_check.sh 2>&1 | tail -20 | tee "$OUT/cpp_embed.log" || status=1
fi
if want bench; then
  timeout 540 python3 -m gemmspec bench --json "$OUT/bench.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" || status=1
fi
if want decode_profile; then
  # The FP8 decode calls (scripts/decode_profile.py) under Nsight Compute: each kernel's
  # time, DRAM bytes and rate, occupancy and warp states, written out as text.
  timeout 240 ncu --clock-control none --profile-from-start off --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section LaunchStats --section Occupancy --section WarpStateStats -o "$OUT/decode" -f \
    python3 scripts/decode_profile.py --calls 1 2>&1 | tail -8 | tee "$OUT/decode_profile.log" || status=1
  ncu -i "$OUT/decode.ncu-rep" --page details > "$OUT/decode_details.txt" 2>&1
  grep -E "^  gs_|Duration|DRAM Throughput|Memory Throughput" "$OUT/decode_details.txt" | tee -a "$OUT/decode_profile.log"
fi
if want tile_rows; then
  # The decode variant's 64-row tiles against 128-row ones over N, K and tokens per expert.
  for part in shapes counts; do
    timeout 280 bash scripts/tile_rows_sweep.sh "$part" "$OUT/tile_rows" > /dev/null 2>&1 || status=1
  done
  cat "$OUT"/tile_rows/*.log
fi
if want ncu; then
  # One profiled launch of the headline GEMM (clocks left as they are): speed of light,
  # warp states, and per-instruction stall samples written out as SASS-level CSV.
  timeout 300 ncu --clock-control none --kernel-name 'regex:^gs_.*_sm90a_e4m3e4m3_bf16_.*_store' --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section WarpStateStats \
    --section SourceCounters --import-source no -o "$OUT/headline" -f \
    python3 -m gemmspec bench --only fp8_fwd_G8x4096_N4096 2>&1 | tail -40 | tee "$OUT/ncu.log" || status=1
  ncu -i "$OUT/headline.ncu-rep" --page details 2>&1 | tail -120 | tee -a "$OUT/ncu.log"
  ncu -i "$OUT/headline.ncu-rep" --page source --print-source sass --csv > "$OUT/headline_sass.csv" 2>&1 || true
fi
exit $status
