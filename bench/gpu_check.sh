#!/usr/bin/env bash
# What the next GPU session should re-check, in one call of the device tool (~9 minutes on the H100), results under
# $OUT:   bash bench/gpu_check.sh      (CUTLASS_DIR set, or the nvidia-cutlass headers installed)
# 1. the GPU tests, split so one slow file cannot starve the rest (on the H100's slow host the 66 core tests need
#    more than 140 s; test_mm_matches_torch alone tunes ~50 problems);
# 2. dynamic M on (11008, 4096) with longer bucket benchmarks (KERNELS_DYNAMIC_BENCH_MS=30 vs the default 10): the
#    worst cases of the last sweeps were buckets decided on one noisy ~37 us timing;
# 3. issue 3's suite with the defaults.
set -u
OUT=${OUT:-results/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
gpu_tests() { timeout 150 python3 -m pytest -q -m gpu --tb=short -p no:cacheprovider "$@" 2>&1 | tail -1; }
gpu_tests tests/test_gpu_core.py -k "test_mm_matches_torch"
gpu_tests tests/test_gpu_core.py -k "not test_mm_matches_torch"
gpu_tests tests/test_dynamic_gpu.py tests/test_isolation.py
gpu_tests tests/test_gpu_templates.py
for ms in 10 30; do
  KERNELS_DYNAMIC_BENCH_MS=$ms timeout 150 python3 -m bench.dynamic --shapes 11008x4096 --num-m 64 --no-table \
    --time-limit-s 130 --out "$OUT/dynamic_11008x4096_bench$ms.json" > "$OUT/dynamic_$ms.txt" 2>&1
  echo "bucket benchmark $ms ms:"; grep -A4 "^| mode" "$OUT/dynamic_11008x4096_bench$ms.md"
done
timeout 130 python3 -m bench.core_quick --suite issue3 --backends aten,triton,padded --json "$OUT/issue3.json" \
  > "$OUT/issue3.txt" 2>&1; grep -E "^(mm|int_mm) " "$OUT/issue3.txt" | head -16
