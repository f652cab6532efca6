#!/usr/bin/env bash
# What is not yet measured on a GPU, in one call of the device tool (~9 minutes on the H200), results under $OUT:
#   bash bench/gpu_check.sh            (CUTLASS_DIR set, or the nvidia-cutlass headers installed, for the CUTLASS tests)
# 1. the GPU tests of the Triton templates (incl. CUDA-graph capture of every launcher) and of the core slice;
# 2. issue 3's suite with the host-bound final-round rule off and on (KERNELS_HOST_BOUND_TOLERANCE), to decide its
#    default: it should keep every speedup and fix host-bound picks like 1024^3's;
# 3. dynamic similarity mode on (11008, 4096), where the outside-the-hints rule should bring M < 64 to <= 1.2x;
# 4. isolated measurement (backends/isolated_child.py) on the GPU: its tests, and what KERNELS_ISOLATE=triton costs a
#    cold tune and a new shape with built binaries (to decide whether Triton can be isolated by default).
set -u
OUT=${OUT:-results/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
timeout 200 python3 -m pytest -q -m gpu tests/test_gpu_templates.py tests/test_gpu_core.py --tb=short \
  -p no:cacheprovider > "$OUT/gpu_tests.txt" 2>&1; tail -3 "$OUT/gpu_tests.txt"
for tol in 0 0.15; do
  KERNELS_HOST_BOUND_TOLERANCE=$tol timeout 130 python3 -m bench.core_quick --suite issue3 \
    --backends aten,triton,padded --json "$OUT/issue3_hb$tol.json" > "$OUT/issue3_hb$tol.txt" 2>&1
  echo "host-bound tolerance $tol:"; grep -E "^(mm|int_mm) " "$OUT/issue3_hb$tol.txt" | head -16
done
timeout 150 python3 -m bench.dynamic --shapes 11008x4096 --no-table --num-m 24 --time-limit-s 130 \
  --out "$OUT/dynamic_11008x4096.json" > "$OUT/dynamic.txt" 2>&1; grep -A4 "^| mode" "$OUT/dynamic_11008x4096.md"
timeout 120 python3 -m pytest -q tests/test_isolation.py tests/test_cutlass_gpu.py -k "isolat or faulting" \
  -p no:cacheprovider 2>&1 | tail -2
for iso in cutlass cutlass,triton; do
  KERNELS_ISOLATE=$iso KERNELS_CACHE_DIR=$(mktemp -d) timeout 120 python3 -c "
import time, torch, kernels
torch.mm(torch.ones(8, 8, device='cuda'), torch.ones(8, 8, device='cuda')); torch.cuda.synchronize()
for m in (1024, 2048):   # the second M reuses the first one's binaries
    a = torch.randn(m, 4096, device='cuda', dtype=torch.bfloat16); b = torch.randn(4096, 4096, device='cuda', dtype=torch.bfloat16)
    t0 = time.perf_counter(); kernels.mm(a, b); torch.cuda.synchronize()
    print('KERNELS_ISOLATE=$iso', m, 'first call s', round(time.perf_counter() - t0, 2), kernels.explain(a, b).winner)
"
done
