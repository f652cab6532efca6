#!/usr/bin/env bash
# One device-tool call's worth of checks, results under $OUT (or results/gpu_check):
#   bash bench/gpu_check.sh native     the C++ table's native launches: GPU tests, then issue 3's and the core suite
#   bash bench/gpu_check.sh issue3     the padded choices' GPU tests, then issue 3's suite
#   bash bench/gpu_check.sh tests      the core, dynamic and isolation GPU tests (54 mm tunes need ~300 s)
#   bash bench/gpu_check.sh templates  tests/gpu/test_templates.py with its gpu_sweep grid, in two runs
#   bash bench/gpu_check.sh dynamic    issue 7's sweeps over 64 M for both (K, N)
#   bash bench/gpu_check.sh fast       issue 6: KERNELS_PRESET=fast on the held-out problems (FAST_DATA: against the
#                                      full-exhaustive files, ~160 s for both dtypes on the H100)
#   bash bench/gpu_check.sh collect    issue 6: the extra list's problems at 96 sampled configs (int8 appended to a
#                                      copy of h100_train_extra_int8.csv, bf16 a new CSV). Ran in the eighth session:
#                                      the new rows are tools/perf_model/data/h100_train_extra2_int8.csv and h100_train_extra_bf16.csv
#   bash bench/gpu_check.sh explore    issue 6: every int8 training problem again, at the shipped model's top 32 plus
#                                      32 configs drawn per problem (--explore), into one new CSV
#   bash bench/gpu_check.sh exhaustive issue 6: the fast preset against a full exhaustive benchmark (20-190 s a problem)
#   bash bench/gpu_check.sh truth      issue 6: every exhaustive candidate timed on the held-out problems not yet in
#                                      tools/perf_model/data/h100_heldout_full_*.csv.gz (offline ground truth for `model eval`)
#   bash bench/gpu_check.sh relabel    issue 6: GPU time of the short problems' candidates (`model relabel`): the
#                                      held-out ones' 96 fastest, then every candidate of the training files' ones
#   bash bench/gpu_check.sh issue27    issue 27 with the CUTLASS set: warmup (timed) on an empty cache, bench.sustained
#                                      (CUTLASS inline for problems outside the set), then each problem's first call
#                                      again with the kernels built and no selections (the cost of a new problem)
#   bash bench/gpu_check.sh issue27bg  issue 27 before the CUTLASS build: an empty cache, the default backends with
#                                      the background build, bench.sustained while it runs; then GPU calls timed while
#                                      a warmup runs on the CPU cores
#   bash bench/gpu_check.sh cost       a new problem's cost with its binaries built (issue 27's <= 3 s): warmup (timed), then
#                                      experiments.new_problem_cost with this tree and BASE_TREE (another checkout) in turn
#                                      (COST_ROUNDS, COST_SET); COST_SUSTAINED=1 adds bench.sustained on the built cache
#   bash bench/gpu_check.sh isolated   the persistent isolated child: warmup of the bf16 set, each issue-27 problem's
#                                      first call with the kernels built (one child for the process), then the GPU
#                                      fault test (a faulting CUTLASS kernel in the child leaves the caller working)
#   bash bench/gpu_check.sh model      issue 28: python -m bench.model on llama-7B's layer (hidden 4096, intermediate
#                                      11008, bf16), an empty cache, one process per part (MODEL_PARTS, default
#                                      "small large train"): forward at M=1,16 (eager, patch, compile) and at
#                                      M=128,2048,8192 (+ max-autotune-no-cudagraphs), forward+backward at M=4096 (eager,
#                                      compile, max-autotune, patch, patch+compile); part "cudagraphs": forward at M=1,16
#                                      with the CUDA-graph pair. JSON lines: $OUT/model_<part>.jsonl. ~8 min on the H100
#   bash bench/gpu_check.sh issue28    issue 28's GPU tests (every Triton family's epilogue, the tuned linear, patch
#                                      forward/backward, torch.compile, enabled(), CUDA graphs; CUTLASS epilogues),
#                                      then the warm host cost of linear / patched nn.Linear against F.linear
#   bash bench/gpu_check.sh fused      kernels.patch's fused blocks: their GPU tests, each block against eager, the llama
#                                      layer forward + backward (M=4096) and forward (M=1024-8192) with and without them
#   bash bench/gpu_check.sh issue30    issue 30: the fp8 GPU tests (Triton families; CUTLASS's with ISSUE30_CUTLASS_TESTS),
#                                      the warm host cost of kernels.scaled_mm, optionally `kernels tune` of
#                                      experiments/issue30_problems.csv (ISSUE30_PRETUNE=1), then bench.sustained --set
#                                      issue30 (ISSUE30_BACKENDS, default aten,triton; ISSUE30_SET or ISSUE30_PROBLEMS),
#                                      CUTLASS built inline; ISSUE30_FASTPATH_TESTS=1 adds the C++ table's fp8 GPU tests
#   bash bench/gpu_check.sh issue29    issue 29's round trip: `kernels tune` of the llama-7B layer's forward problems
#                                      (M=1..4096) in cache A, `cache export`, `cache import` into an empty cache B,
#                                      then a fresh process's first call of every problem (experiments.bundle_first_calls)
#   bash bench/gpu_check.sh issue31    issue 31 on a multi-GPU kind: `kernels tune --gpus` of experiments/issue31_problems.csv
#                                      (llama-7B's four projection shapes x 8 M, bf16 nt): cold on every GPU, then from an
#                                      empty selection store with the binaries built, on each GPU set of ISSUE31_SETS
#                                      (default "0 all"), each with a timeline (experiments.issue31_timeline); winners
#                                      compared with GPU 0's (experiments.issue31_compare); then the multi-GPU tests
#                                      (ISSUE31_TESTS=0 leaves them out)
#   bash bench/gpu_check.sh issue31ddp bench.model_ddp (llama-7B's layer, M=4096 a rank) on one GPU and on DDP_GPUS (default
#                                      2), the first step from an empty selection store each (binaries built by a first run)
# (CUTLASS_DIR set, or the nvidia-cutlass headers installed: `source .device/setup.sh` on the device machine)
set -u
OUT=${OUT:-results/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
gpu_tests() { local t=$1; shift; timeout "$t" python3 -m pytest -q -m gpu --tb=short -p no:cacheprovider "$@" 2>&1 | tail -25; }
timed_warmups() {   # the CUTLASS set of each of WARMUP_DTYPES (default bf16 int8), timed into $OUT/warmup_times.txt
  for d in ${WARMUP_DTYPES:-bf16 int8}; do
    local s0; s0=$(date +%s%N); python3 -m kernels warmup --backends cutlass --dtypes "$d" > "$OUT/warmup_$d.txt" 2>&1
    echo "warmup $d: rc $? $(( ($(date +%s%N) - s0) / 1000000 )) ms" | tee -a "$OUT/warmup_times.txt"
    tail -1 "$OUT/warmup_$d.txt"
  done
}
case "${1:-native}" in
model)
  # MODEL_KEEP_CACHE=1 keeps the kernels cache of a warm machine (the cost of a new problem with binaries built);
  # MODEL_SECONDS: each timing loop (default 1). Each part gets its --time-limit (start no new variant after it),
  # trimmed so that the whole mode ends by ~570 s.
  export KERNELS_CACHE_DIR=/tmp/kernels_model
  [ "${MODEL_KEEP_CACHE:-0}" = 1 ] || rm -rf "$KERNELS_CACHE_DIR"
  python3 -m kernels fastpath build > /dev/null 2>&1
  common="--hidden 4096 --intermediate 11008 --layers 1 --dtype bf16 --seconds ${MODEL_SECONDS:-1} --rounds 2 --quiet"
  for part in ${MODEL_PARTS:-small large train}; do
    case $part in
      small) limit=70; args="--mode fwd --tokens 1,16 --variants eager,patch,compile" ;;
      large) limit=190; args="--mode fwd --tokens 128,2048,8192 --variants eager,patch,max-autotune,compile" ;;
      smalltrain) limit=150; args="--mode fwdbwd --tokens 16,128 --variants eager,patch,compile" ;;
      m128) limit=100; args="--mode fwd --tokens 128 --variants eager,patch,patch+compile,compile --rounds 3" ;;
      combo) limit=150; args="--mode fwd --tokens 128,2048,8192 --variants eager,patch,patch+compile,compile" ;;
      train) limit=${MODEL_TRAIN_LIMIT:-150}; args="--mode fwdbwd --tokens 4096 --variants eager,compile,max-autotune,patch,patch+compile" ;;
      cudagraphs) limit=150; args="--mode fwd --tokens 1,16 --variants eager,patch --cudagraphs" ;;
      *) echo "model: unknown part $part (small, large, combo, train, cudagraphs)"; continue ;;
    esac
    left=$((570 - SECONDS)); [ "$left" -gt 60 ] || { echo "model $part: no time left"; continue; }
    [ "$limit" -lt $((left - 60)) ] || limit=$((left - 60))
    # shellcheck disable=SC2086 - $common and $args are lists of flags
    timeout "$left" python3 -m bench.model $common $args --time-limit "$limit" --json "$OUT/model_$part.jsonl" \
      > "$OUT/model_$part.txt" 2>&1
    echo "model $part: rc $? at $SECONDS s"; grep -v "^\[" "$OUT/model_$part.txt" | tail -28
  done
  ;;
issue27)
  export KERNELS_CACHE_DIR=/tmp/kernels_issue27; rm -rf "$KERNELS_CACHE_DIR"
  python3 -m kernels fastpath build > /dev/null 2>&1
  timed_warmups
  python3 -m kernels info 2>&1 | tail -2
  KERNELS_CUTLASS_BUILD=inline timeout 380 python3 -m bench.sustained --json "$OUT/sustained_cutlass.jsonl" \
    --time-limit 340 --quiet > "$OUT/sustained_cutlass.txt" 2>&1; tail -22 "$OUT/sustained_cutlass.txt"
  rm -rf "$KERNELS_CACHE_DIR/selections"
  KERNELS_CUTLASS_BUILD=off timeout 80 python3 -m experiments.new_problem_cost > "$OUT/new_problem_cost.jsonl" 2>&1
  cut -c1-160 "$OUT/new_problem_cost.jsonl"
  ;;
fused)
  # kernels.patch's fused blocks: their GPU tests, each block alone against eager, then the llama layer with and
  # without them (forward + backward at M=4096, forward at M=1024,2048,8192; aten,triton,padded; 2 rounds)
  export KERNELS_CACHE_DIR=/tmp/kernels_fused; rm -rf "$KERNELS_CACHE_DIR"
  gpu_tests 120 tests/gpu/test_fused.py | tee "$OUT/pytest_fused.txt"
  timeout 90 python3 -m experiments.fused_blocks --m 1024,4096 --json "$OUT/fused_blocks.jsonl" 2>&1 | tee "$OUT/fused_blocks.txt"
  KERNELS_BACKENDS=aten,triton,padded timeout 160 python3 -m bench.model --mode fwdbwd --tokens 4096 \
    --variants eager,patch,patch-linear --json "$OUT/model_fused_fwdbwd.jsonl" --quiet 2>&1 | tail -12
  KERNELS_BACKENDS=aten,triton,padded timeout 160 python3 -m bench.model --mode fwd --tokens 1024,2048,8192 \
    --variants eager,patch,patch-linear --json "$OUT/model_fused_fwd.jsonl" --quiet 2>&1 | tail -16
  ;;
issue28)
  export KERNELS_CACHE_DIR=/tmp/kernels_issue28; rm -rf "$KERNELS_CACHE_DIR"
  python3 -m kernels fastpath build > /dev/null 2>&1
  [ "${ISSUE28_HOST:-1}" = 1 ] && {
  timeout 100 python3 -m experiments.linear_host_cost --json "$OUT/linear_host_cost.json" 2>&1 | tee "$OUT/linear_host_cost.txt"
  timeout 100 python3 -m experiments.linear_host_cost --m 16 --backends aten,triton 2>&1 | tee "$OUT/linear_host_cost_m16.txt"; }
  gpu_tests 200 tests/gpu/test_linear.py tests/gpu/test_model_integration.py | tee "$OUT/pytest_linear.txt"
  gpu_tests 250 tests/gpu/test_cutlass.py -k epilogue | tee "$OUT/pytest_cutlass_epilogue.txt"
  ;;
issue30)
  # ISSUE30_TESTS=0 / ISSUE30_HOST=0 skip the GPU tests / the host cost; ISSUE30_PRETUNE=1 tunes the problem list
  # first with `kernels tune` (CUTLASS candidates of every problem built in one batch), so the loops read the store
  export KERNELS_CACHE_DIR=/tmp/kernels_issue30; rm -rf "$KERNELS_CACHE_DIR"
  backends=${ISSUE30_BACKENDS:-aten,triton}
  python3 -m kernels fastpath build > /dev/null 2>&1
  [ "${ISSUE30_TESTS:-1}" = 1 ] && gpu_tests ${ISSUE30_TEST_S:-150} tests/gpu/test_scaled_mm.py | tee "$OUT/pytest_scaled_mm.txt"
  [ -n "${ISSUE30_CUTLASS_TESTS:-}" ] && gpu_tests 200 tests/gpu/test_cutlass.py -k "scaled" | tee "$OUT/pytest_cutlass_scaled.txt"
  [ -n "${ISSUE30_FASTPATH_TESTS:-}" ] && gpu_tests 120 tests/gpu/test_fastpath.py -k "scaled" | tee "$OUT/pytest_fastpath_scaled.txt"
  [ "${ISSUE30_HOST:-1}" = 1 ] && timeout 120 python3 -m experiments.scaled_host_cost --json "$OUT/scaled_host_cost.json" 2>&1 | tee "$OUT/scaled_host_cost.txt"
  if [ "${ISSUE30_PRETUNE:-0}" = 1 ]; then
    s0=$SECONDS
    timeout 330 python3 -m kernels tune experiments/issue30_problems.csv --backends "$backends" --time-limit 300 \
      > "$OUT/tune_fp8.txt" 2>&1
    echo "kernels tune: rc $? $((SECONDS - s0)) s"; grep -v "^\[" "$OUT/tune_fp8.txt" | tail -16
  fi
  left=$((570 - SECONDS)); [ "$left" -gt 60 ] || { echo "issue30: no time left for bench.sustained"; exit 0; }
  if [ -n "${ISSUE30_PROBLEMS:-}" ]; then which="--problems $ISSUE30_PROBLEMS"; else which="--set ${ISSUE30_SET:-issue30}"; fi
  # shellcheck disable=SC2086 - $which is two words
  KERNELS_CUTLASS_BUILD=inline timeout "$left" python3 -m bench.sustained $which \
    --backends "$backends" --json "$OUT/sustained_fp8.jsonl" --time-limit $((left - 50)) --quiet \
    > "$OUT/sustained_fp8.txt" 2>&1; echo "sustained: rc $? at $SECONDS s"; tail -30 "$OUT/sustained_fp8.txt"
  ;;
issue31)
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1     # NVLink multicast off
  export KERNELS_CACHE_DIR=/tmp/kernels_issue31; rm -rf "$KERNELS_CACHE_DIR"
  LIST=${ISSUE31_LIST:-experiments/issue31_problems.csv}
  nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
  python3 -m kernels fastpath build > /dev/null 2>&1
  tune_run() {   # name timeout args...: one `kernels tune` run, its wall time, and a copy of the selections
    local name=$1 t=$2; shift 2; local s0=$(date +%s%N)
    ISSUE31_T0_NS=$s0 timeout "$t" python3 -m experiments.issue31_timeline "$OUT/timeline_$name.jsonl" -- \
      tune "$LIST" "$@" > "$OUT/tune_$name.txt" 2>&1; local rc=$?
    echo "$name ($*): rc $rc, $(( ($(date +%s%N) - s0) / 1000000 )) ms" | tee -a "$OUT/issue31_times.txt"
    grep -v "^\[" "$OUT/tune_$name.txt" | tail -8
    rm -rf "/tmp/issue31_sel_$name"; cp -r "$KERNELS_CACHE_DIR/selections" "/tmp/issue31_sel_$name" 2>/dev/null
    tar czf "$OUT/sel_$name.tgz" -C /tmp "issue31_sel_$name" 2>/dev/null
  }
  tune_run cold_all 330 --gpus "${ISSUE31_GPUS:-all}"
  rm -rf "$KERNELS_CACHE_DIR/selections"
  # a worker's start alone (imports, CUDA, its isolated child), with the imports' times
  ( s0=$(date +%s%N); CUDA_VISIBLE_DEVICES=0 python3 -X importtime -m kernels.dispatch.tune_worker < /dev/null \
      > /dev/null 2> "$OUT/worker_importtime.txt"
    echo "a worker's start and exit alone: $(( ($(date +%s%N) - s0) / 1000000 )) ms" | tee -a "$OUT/issue31_times.txt" )
  # then from an empty selection store with the binaries built, on each GPU set of ISSUE31_SETS
  for gpus in ${ISSUE31_SETS:-0 ${ISSUE31_GPUS:-all}}; do
    rm -rf "$KERNELS_CACHE_DIR/selections"
    tune_run "built_${gpus//,/_}" 240 --gpus "$gpus"
  done
  for gpus in ${ISSUE31_SETS:-0 ${ISSUE31_GPUS:-all}}; do
    [ "$gpus" = 0 ] && continue
    python3 -m experiments.issue31_compare /tmp/issue31_sel_built_0 "/tmp/issue31_sel_built_${gpus//,/_}" \
      --json "$OUT/compare_${gpus//,/_}.json" > "$OUT/compare_${gpus//,/_}.md" 2>&1; tail -1 "$OUT/compare_${gpus//,/_}.md"
  done
  [ "${ISSUE31_TESTS:-1}" = 1 ] && gpu_tests 240 tests/gpu/test_multi_gpu.py -k "not model_ddp" \
    | tee "$OUT/multi_gpu_tests.txt"
  ;;
issue31ddp)
  # the first step's tunes on one GPU and on every GPU, each from an empty selection store, with the binaries built
  # by a first run (CUTLASS inline: a background build would leave the measured runs' problems pending)
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 KERNELS_CUTLASS_BUILD=inline
  export KERNELS_CACHE_DIR=/tmp/kernels_issue31ddp; rm -rf "$KERNELS_CACHE_DIR"
  python3 -m kernels fastpath build > /dev/null 2>&1
  common="--hidden 4096 --intermediate 11008 --layers 1 --dtype bf16 --tokens ${DDP_TOKENS:-4096} --seconds 1"
  s0=$SECONDS
  timeout 240 python3 -m bench.model_ddp $common --rounds 1 --gpus "${DDP_GPUS:-2}" > "$OUT/ddp_build.txt" 2>&1
  echo "binaries built (cold run on ${DDP_GPUS:-2} GPUs): rc $?, $((SECONDS - s0)) s"; tail -12 "$OUT/ddp_build.txt"
  for n in 1 ${DDP_GPUS:-2}; do
    rm -rf "$KERNELS_CACHE_DIR/selections"
    timeout 200 python3 -m bench.model_ddp $common --rounds 2 --gpus "$n" --json "$OUT/ddp_$n.jsonl" \
      > "$OUT/ddp_$n.txt" 2>&1
    echo "ddp on $n GPU(s): rc $?"; tail -12 "$OUT/ddp_$n.txt"
  done
  ;;
issue29)
  # the bundle round trip, then the shared store: a redis-server carried in .device/bin (Debian's, with its libraries)
  export KERNELS_BACKENDS=${KERNELS_BACKENDS:-aten,triton,padded}
  export PATH=$PWD/.device/bin:$PATH
  A=/tmp/kernels_fleet_a; B=/tmp/kernels_fleet_b; C=/tmp/kernels_fleet_c; TRACE=experiments/llama7b_layer_forward.csv
  rm -rf "$A" "$B" "$C" /tmp/layer_bundle.tar.gz /tmp/redis_gpu; mkdir -p /tmp/redis_gpu
  redis-server --port 6399 --bind 127.0.0.1 --save "" --appendonly no --dir /tmp/redis_gpu --daemonize yes \
    --loglevel warning || echo "redis-server did not start"
  STORE=redis://127.0.0.1:6399/0
  KERNELS_CACHE_DIR=$A python3 -m kernels fastpath build > /dev/null 2>&1
  s0=$SECONDS
  KERNELS_CACHE_DIR=$A KERNELS_STORE=$STORE timeout 330 python3 -m kernels tune $TRACE --time-limit 280 \
    > "$OUT/tune.txt" 2>&1
  echo "tune (publishing to $STORE): rc $? $((SECONDS - s0)) s" | tee -a "$OUT/tune.txt"; grep -v "^\[" "$OUT/tune.txt" | tail -28
  KERNELS_CACHE_DIR=$A python3 -m kernels cache export /tmp/layer_bundle.tar.gz 2>&1 | tail -3 | tee "$OUT/bundle.txt"
  ls -l /tmp/layer_bundle.tar.gz | tee -a "$OUT/bundle.txt"
  s0=$(date +%s%N)
  KERNELS_CACHE_DIR=$B python3 -m kernels cache import /tmp/layer_bundle.tar.gz 2>&1 | tail -3 | tee -a "$OUT/bundle.txt"
  echo "import: $(( ($(date +%s%N) - s0) / 1000000 )) ms" | tee -a "$OUT/bundle.txt"
  for run in 1 2; do      # two fresh processes: what the first pays once per cache, and what every process pays
    echo "== bundle: fresh process $run in the imported cache" | tee -a "$OUT/first_calls.jsonl"
    KERNELS_CACHE_DIR=$B timeout 150 python3 -m experiments.bundle_first_calls $TRACE --profile "$OUT/profile_$run.txt" \
      >> "$OUT/first_calls.jsonl" 2>&1; tail -3 "$OUT/first_calls.jsonl"
  done
  echo "== bundle: fresh process 3, kernels.preload() before the timed calls" | tee -a "$OUT/first_calls.jsonl"
  KERNELS_CACHE_DIR=$B timeout 150 python3 -m experiments.bundle_first_calls $TRACE --init-triton --preload \
    >> "$OUT/first_calls.jsonl" 2>&1; tail -3 "$OUT/first_calls.jsonl"
  for run in 1 2; do      # the shared store instead of a bundle: an empty cache, selections from Redis
    echo "== store: fresh process $run in an empty cache with KERNELS_STORE" | tee -a "$OUT/store_calls.jsonl"
    KERNELS_CACHE_DIR=$C KERNELS_STORE=$STORE timeout 240 python3 -m experiments.bundle_first_calls $TRACE \
      >> "$OUT/store_calls.jsonl" 2>&1; tail -2 "$OUT/store_calls.jsonl"
  done
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/unit/test_shared_store.py 2>&1 | tail -3
  pkill -f redis-server.bin
  ;;
isolated)
  export KERNELS_CACHE_DIR=/tmp/kernels_isolated; rm -rf "$KERNELS_CACHE_DIR"
  python3 -m kernels fastpath build > /dev/null 2>&1
  s0=$(date +%s%N); python3 -m kernels warmup --backends cutlass --dtypes bf16 > "$OUT/warmup_bf16.txt" 2>&1
  echo "warmup bf16: rc $? $(( ($(date +%s%N) - s0) / 1000000 )) ms" | tee "$OUT/warmup_times.txt"
  KERNELS_CUTLASS_BUILD=off timeout 120 python3 -m experiments.new_problem_cost --set issue27-bf16 \
    > "$OUT/new_problem_cost.jsonl" 2>&1; cut -c1-230 "$OUT/new_problem_cost.jsonl"
  gpu_tests 150 tests/gpu/test_cutlass.py -m "gpu or gpu_sweep" -k test_faulting_kernel_in_child | tee "$OUT/fault_test.txt"
  ;;
cost)
  # a new problem's cost with its binaries built: the set's warmup (timed), a first pass of experiments.new_problem_cost
  # (it compiles the Triton candidates), then COST_ROUNDS rounds of it with this tree and, with BASE_TREE (another
  # checkout), with that one, each from an empty selection store. COST_SUSTAINED=1 then runs bench.sustained.
  export KERNELS_CACHE_DIR=/tmp/kernels_cost; rm -rf "$KERNELS_CACHE_DIR"
  python3 -m kernels fastpath build > /dev/null 2>&1
  timed_warmups
  cost_run() {   # name dir: one process, every problem's first call
    rm -rf "$KERNELS_CACHE_DIR/selections"
    ( cd "$2" && PYTHONPATH=/tmp/site:$PWD KERNELS_CUTLASS_BUILD=off timeout 150 python3 -m experiments.new_problem_cost \
        --set "${COST_SET:-issue27}" ) > "$OUT/cost_$1.jsonl" 2>&1
    python3 -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1]) if l.startswith('{')]; \
print(sys.argv[2], 'problems', len(r), 'first %.1f s' % r[0]['first_call_s'] if r else '', \
'later mean %.2f s max %.2f s' % (sum(x['first_call_s'] for x in r[1:]) / max(1, len(r) - 1), \
max([x['first_call_s'] for x in r[1:]] or [0])))" "$OUT/cost_$1.jsonl" "$1" | tee -a "$OUT/cost_summary.txt"
  }
  cost_run prime "$PWD"
  for r in $(seq 1 "${COST_ROUNDS:-2}"); do
    [ -n "${BASE_TREE:-}" ] && cost_run "base_$r" "$BASE_TREE"
    cost_run "this_$r" "$PWD"
  done
  if [ "${COST_SUSTAINED:-0}" = 1 ]; then
    rm -rf "$KERNELS_CACHE_DIR/selections"
    KERNELS_CUTLASS_BUILD=inline timeout "${SUSTAINED_T:-380}" python3 -m bench.sustained --json "$OUT/sustained.jsonl" \
      --time-limit "$(( ${SUSTAINED_T:-380} - 40 ))" --quiet > "$OUT/sustained.txt" 2>&1; tail -22 "$OUT/sustained.txt"
  fi
  ;;
issue27bg)
  export KERNELS_CACHE_DIR=/tmp/kernels_issue27bg; rm -rf "$KERNELS_CACHE_DIR"
  timeout 290 python3 -m bench.sustained --json "$OUT/sustained_background.jsonl" --time-limit 250 --quiet \
    > "$OUT/sustained_background.txt" 2>&1; tail -22 "$OUT/sustained_background.txt"
  python3 -m kernels info 2>&1 | tail -2
  rm -rf "$KERNELS_CACHE_DIR/selections"
  KERNELS_CUTLASS_BUILD=off timeout 90 python3 -m experiments.new_problem_cost > "$OUT/new_problem_cost.jsonl" 2>&1
  cut -c1-200 "$OUT/new_problem_cost.jsonl"
  export KERNELS_CACHE_DIR=/tmp/kernels_interference; rm -rf "$KERNELS_CACHE_DIR"
  timeout 120 python3 -m experiments.build_interference --json "$OUT/build_interference.json" \
    --during "timeout 40 nice -n 19 python3 -m kernels warmup --backends cutlass --dtypes fp16" \
    > "$OUT/build_interference.txt" 2>&1; tail -30 "$OUT/build_interference.txt"
  ;;
native)
  python3 -m kernels fastpath build
  gpu_tests 240 tests/gpu/test_fastpath.py | tee "$OUT/fastpath_tests.txt"
  timeout 170 python3 -m experiments.core_quick --suite issue3 --backends aten,triton,padded --json "$OUT/issue3.json" \
    > "$OUT/issue3.txt" 2>&1; tail -28 "$OUT/issue3.txt"
  timeout 150 python3 -m experiments.core_quick --suite core --backends aten,triton,padded --json "$OUT/core.json" \
    > "$OUT/core.txt" 2>&1; tail -22 "$OUT/core.txt"
  ;;
issue3)
  python3 -m kernels fastpath build
  gpu_tests 200 tests/gpu/test_templates.py -k "padded"
  timeout 200 python3 -m experiments.core_quick --suite issue3 --backends aten,triton,padded --json "$OUT/issue3.json" \
    > "$OUT/issue3.txt" 2>&1; tail -28 "$OUT/issue3.txt"
  ;;
tests)
  # 35 of the 54 mm tunes passed in 210 s on the H100 (seventh session)
  gpu_tests 360 tests/gpu/test_core.py -m "gpu or gpu_sweep" -k "test_mm_matches_torch"
  gpu_tests 170 tests/gpu/test_core.py tests/gpu/test_dynamic.py -k "not test_mm_matches_torch"
  ;;
templates)
  gpu_tests 250 tests/gpu/test_templates.py -m "gpu or gpu_sweep" -k "test_bf16_template"
  gpu_tests 250 tests/gpu/test_templates.py -m "gpu or gpu_sweep" -k "not test_bf16_template"
  ;;
dynamic)
  for kn in 11008x4096 4096x12288; do
    timeout 280 python3 -m bench.dynamic --shapes "$kn" --num-m 64 --time-limit-s 250 \
      --out "$OUT/dynamic_$kn.json" > "$OUT/dynamic_$kn.txt" 2>&1
    grep -B2 -A6 "^| mode" "$OUT/dynamic_$kn.md" 2>/dev/null || tail -20 "$OUT/dynamic_$kn.txt"
  done
  ;;
collect)
  # 18 int8 + 32 bf16 problems took 322 s on the H100 (eighth session); --resume skips what the copy already holds
  cp tools/perf_model/data/h100_train_extra_int8.csv "$OUT/"
  timeout 280 python3 -m tools.perf_model collect --shapes tools/perf_model/data/shapes_train_extra.txt --dtypes int8 --resume \
    --max-configs 96 --time-limit 240 --out "$OUT/h100_train_extra_int8.csv" 2>&1 | tail -16
  timeout 280 python3 -m tools.perf_model collect --shapes tools/perf_model/data/shapes_train_extra.txt --dtypes bf16 \
    --max-configs 96 --time-limit 240 --out "$OUT/h100_train_extra_bf16.csv" 2>&1 | tail -16
  ;;
explore)
  # train, thin, then extra shape lists into one file; each list gets what is left of ~270 s
  # (EXPLORE_SHAPES: other lists, e.g. tools/perf_model/data/shapes_train_skinny.txt, the eleventh session's)
  for shapes in ${EXPLORE_SHAPES:-train tools/perf_model/data/shapes_train_thin.txt tools/perf_model/data/shapes_train_extra.txt}; do
    left=$((270 - SECONDS)); [ "$left" -gt 20 ] || break
    timeout $((left + 30)) python3 -m tools.perf_model collect --shapes "$shapes" --dtypes int8 --explore --resume \
      --max-configs 64 --time-limit "$left" --out "$OUT/h100_explore_int8.csv" 2>&1 | tail -4
  done
  ;;
exhaustive)
  # EXHAUSTIVE_S (default 400): start no new problem after this; the stage ends by EXHAUSTIVE_S + 160 s.
  # EXHAUSTIVE_PROBLEMS: DTYPE:MxNxK,... instead of the list below (the first int8 problem compiles ~3,600 kernels)
  limit=${EXHAUSTIVE_S:-400}
  problems=${EXHAUSTIVE_PROBLEMS:-int8:640x2560x10240,bf16:4096x128x4096,int8:1234x4321x2345,bf16:768x768x768,int8:200x5120x5120}
  timeout $((limit + 160)) python3 -m experiments.exhaustive_reference --time-limit-s "$limit" \
    --json "$OUT/exhaustive_reference.json" --truth-csv "$OUT/exhaustive_truth.csv" \
    --problems "$problems" \
    2>&1 | grep -v Warning | tee "$OUT/exhaustive_reference.txt" | tail -8
  ;;
truth)
  # TRUTH_DTYPE (int8 or bf16, default int8): the held-out list, resumed against the committed ground truth (problems
  # already there are skipped); only the new problems' rows come back, as $OUT/h100_heldout_full_<dtype>_new.csv.gz
  # (append: gzip -dc NEW | tail -n +2 | gzip >> tools/perf_model/data/h100_heldout_full_<dtype>.csv.gz). 20-190 s a problem.
  # A warm machine keeps the last call's rows in /tmp: resume from them unless the committed file is ahead.
  dtype=${TRUTH_DTYPE:-int8}; truth=/tmp/h100_heldout_full_$dtype.csv
  committed=tools/perf_model/data/h100_heldout_full_$dtype.csv.gz; before=$(gzip -dc "$committed" | wc -l)
  if [ ! -f "$truth" ] || [ "$(wc -l < "$truth")" -lt "$before" ]; then gzip -dc "$committed" > "$truth"; fi
  timeout "${TRUTH_TIMEOUT:-570}" python3 -m tools.perf_model collect --dtypes "$dtype" --max-configs 0 \
    --time-limit "${TRUTH_S:-420}" --shapes heldout --resume --out "$truth" 2>&1 | grep -v Warning \
    | tee "$OUT/truth_$dtype.txt" | tail -16
  { head -1 "$truth"; tail -n +$((before + 1)) "$truth"; } | gzip > "$OUT/h100_heldout_full_${dtype}_new.csv.gz"
  ;;
relabel)
  # RELABEL_S (default 480): start no new problem after this. Held-out first (the offline ground truth for scoring:
  # RELABEL_TOP fastest calls of each, default 96, 0 = every candidate; RELABEL_HELD_US: problems under it, default
  # 25), then the training files' problems, every candidate, the shortest first (RELABEL_TRAIN=0 skips them). A warm
  # machine resumes from its /tmp files. Both come back gzipped.
  limit=${RELABEL_S:-480}; held=/tmp/h100_heldout_gpu.csv; train=/tmp/h100_train_gpu.csv
  held_s=$limit; [ "${RELABEL_TRAIN:-1}" = 0 ] || held_s=$((limit / 4))
  timeout $((limit + 60)) python3 -m tools.perf_model relabel --top "${RELABEL_TOP:-96}" --time-limit "$held_s" \
    --below-us "${RELABEL_HELD_US:-25}" --out "$held" \
    --data tools/perf_model/data/h100_heldout_full_int8.csv.gz tools/perf_model/data/h100_heldout_full_bf16.csv.gz 2>&1 | tail -16
  left=$((limit - SECONDS)); [ "${RELABEL_TRAIN:-1}" != 0 ] && [ "$left" -gt 20 ] && \
    timeout $((left + 60)) python3 -m tools.perf_model relabel --time-limit "$left" --out "$train" \
      --data tools/perf_model/data/h100_train_*.csv tools/perf_model/data/h100_explore_*.csv 2>&1 | tail -70
  for f in "$held" "$train"; do [ -f "$f" ] && gzip -c "$f" > "$OUT/$(basename "$f").gz"; done
  ;;
fast)
  # FAST_DATA: the reference datasets (default the 48-96-config samples; the full-exhaustive ground truth is
  # tools/perf_model/data/h100_heldout_full_{bf16,int8}.csv.gz); FAST_S (default 500): start no new problem after this
  # FAST_TAG: a suffix for the output files (e.g. a run with FAST_MODEL=<another model's .json>, its --perf-model)
  data=${FAST_DATA:-tools/perf_model/data/h100_heldout_bf16.csv tools/perf_model/data/h100_heldout_int8.csv}; limit=${FAST_S:-500}
  tag=${FAST_TAG:+_$FAST_TAG}
  # shellcheck disable=SC2086 - $data is a list of paths
  timeout $((limit + 60)) python3 -m experiments.fast_preset --data $data ${FAST_MODEL:+--perf-model "$FAST_MODEL"} \
    --time-limit-s "$limit" --json "$OUT/fast_preset$tag.json" 2>&1 | tee "$OUT/fast_preset$tag.txt" | tail -60
  ;;
esac
