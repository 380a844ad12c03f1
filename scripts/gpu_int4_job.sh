#!/usr/bin/env bash
# The INT4 KV path's device checks and benches in one job, for a CUDA machine without the project's environment
# (the pure-Python packages in .gpucarry/site, as for scripts/gpu_study_job.sh; docs/PERFORMANCE.md, "Next on the
# device"). It took 457 s on one H100 (2026-12-05): start it in the background and poll $OUT/job.done.
#  1. the two-launch draw's CUDA tests (tests/test_sampler_cuda.py -> $OUT/sampler_tests.log), then the CUDA test
#     files (TEST_FILES, default all of tests/*_cuda.py) with the plain caches on the route PLAIN_ATTENTION names
#     (default torch, the project's default; kernel: the raw-value kernel), the INT4 caches on the route
#     INT4_ATTENTION names (default rotated, the project's; dequant: the dequantizing kernel) and the fused
#     pre-attention as FUSED_PRE says (default on, the project's; off) (TESTS_TIMEOUT, default 400 s)
#     -> $OUT/cuda_tests.log
#  2. the draw timed, unfused against two launches (tests/bench/gpu_sampler.py) -> $OUT/sampler.json
#  3. the INT4 bench (tests/bench/gpu_int4_decode_variants.py --max-batch --budget BUDGET, default 300): the rotated
#     kernel's variants (both forms), the length sweep, the formats' rows at batch 64 and at the largest batch in
#     BF16's KV bytes, packed against simulated; with the two-launch draw (PARITY_FUSED_SAMPLER=on) when its own
#     tests (tests/test_sampler_cuda.py, run first) passed -> $OUT/int4_variants.json
#  4. with COUNTDOWN=1: "one INT4 format" on the trained Countdown model: the `gpu` preset's warm start (seed 3, built
#     in the job while step 1 runs), then tests/bench/int4_decode_vs_forward.py over bf16 and the INT4 cache on the
#     dequantizing kernel, the rotated kernel, and the rotated kernel after the fused pre-attention
#     -> $OUT/one_format_countdown.json
#  5. with FUSED_PRE_AB=1: which part of the fused pre-attention step moves the packed INT4 path from the simulated
#     cache on the CUDA tests' small model (tests/bench/gpu_fused_pre_one_format.py) -> $OUT/fused_pre_one_format.json,
#     and how Inductor's compiled norm and rotary round on the device (tests/bench/inductor_rounding.py, in its log)
#  6. with PRE_AB=1: the W8A8 + INT4 row with the fused pre-attention on and off in turn, twice
#     (tests/bench/gpu_int4_decode_variants.py --pre-ab) -> $OUT/pre_ab.json; with READ_CEILING=1: a read-only kernel
#     over the INT4 cache's bytes in the attention's layout beside the attention (tests/bench/gpu_read_ceiling.py)
#     -> $OUT/read_ceiling.json
# Each step's output lands in $OUT when the step ends, its exit status in $OUT/steps.txt; $OUT/job.done at the end.
# SKIP_TESTS=1 skips step 1 (the bench then runs with the unfused draw); SKIP_BENCH=1 skips steps 2 and 3.
#   usage: [BUDGET=300] [TESTS_TIMEOUT=400] [PLAIN_ATTENTION=kernel] [INT4_ATTENTION=dequant] [FUSED_PRE=off] \
#          [TEST_FILES=...] \
#          [SKIP_TESTS=1] [SKIP_BENCH=1] \
#          [COUNTDOWN=1] [FUSED_PRE_AB=1] [PRE_AB=1] [READ_CEILING=1] bash scripts/gpu_int4_job.sh
set -u
orig=$PWD; copy=$(mktemp -d /tmp/parity-int4.XXXXXX)/tree
cp -r "$orig" "$copy" && cd "$copy" || { echo "could not copy the tree to $copy"; exit 1; }
out=${OUT:-/tmp/out}; mkdir -p "$out"
export PYTHONPATH=$PWD/platform:$PWD:$PWD/tests/bench:$PWD/.gpucarry/site PYTHONUNBUFFERED=1
t0=$(date +%s)
step() { echo "$1 exit $2 at $(( $(date +%s) - t0 )) s" | tee -a "$out/steps.txt"; }
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee "$out/steps.txt"
fused=""
if [ -n "${COUNTDOWN:-}" ]; then  # the warm start, beside the tests (it takes minutes of its own)
  base=$(python3 -c "from parity.study.presets import PRESETS; p=PRESETS['gpu']; print(' '.join(['experiment='+p.experiment, *p.base]))")
  # shellcheck disable=SC2086  # base is a list of overrides
  (python3 -m parity prepare outputs_dir=/tmp/parity-warm $base model.warm_start.seed=3 > "$out/prepare.log" 2>&1;
   echo $? > "$out/prepare.rc") &
fi
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout 200 python3 -m pytest -q -rP -p no:cacheprovider tests/test_sampler_cuda.py > "$out/sampler_tests.log" 2>&1
  rc=$?; step "sampler tests" $rc; tail -n 2 "$out/sampler_tests.log"
  [ $rc -eq 0 ] && fused=on
  # shellcheck disable=SC2086  # TEST_FILES is a list of paths
  PARITY_PLAIN_ATTENTION=${PLAIN_ATTENTION:-torch} PARITY_INT4_ATTENTION=${INT4_ATTENTION:-rotated} \
    PARITY_FUSED_PRE_ATTENTION=${FUSED_PRE:-on} timeout "${TESTS_TIMEOUT:-400}" \
    python3 -m pytest -q -n 8 -rP -p no:cacheprovider ${TEST_FILES:-tests/*_cuda.py} > "$out/cuda_tests.log" 2>&1
  step "tests (plain: ${PLAIN_ATTENTION:-torch}, int4: ${INT4_ATTENTION:-rotated}, fused pre: ${FUSED_PRE:-on})" $?
  tail -n 3 "$out/cuda_tests.log"
fi
if [ -z "${SKIP_BENCH:-}" ]; then
  python3 tests/bench/gpu_sampler.py --out "$out/sampler.json" > "$out/sampler.log" 2>&1
  step sampler $?; tail -n 5 "$out/sampler.log"
  PARITY_FUSED_SAMPLER=${fused:-off} python3 tests/bench/gpu_int4_decode_variants.py --max-batch \
    --budget "${BUDGET:-300}" --out "$out/int4_variants.json" > "$out/int4_variants.log" 2>&1
  step "int4 bench (PARITY_FUSED_SAMPLER=${fused:-off})" $?; tail -n 30 "$out/int4_variants.log"
fi
if [ -n "${COUNTDOWN:-}" ]; then
  wait
  step "warm start" "$(cat "$out/prepare.rc")"
  model_dir=$(tail -n 1 "$out/prepare.log" | python3 -c "import json, sys; print(json.load(sys.stdin)['model_dir'])")
  python3 tests/bench/int4_decode_vs_forward.py --model-dir "$model_dir" --device cuda --prompts 8 --samples 8 \
    --tokens 160 --rows "int4_per_token_head, dequantizing kernel;int4_per_token_head, rotated kernel;\
int4_per_token_head, rotated kernel + fused pre-attention" \
    --out "$out/one_format_countdown.json" > "$out/one_format_countdown.log" 2>&1
  step "one format, Countdown" $?; tail -n 8 "$out/one_format_countdown.log"
fi
if [ -n "${FUSED_PRE_AB:-}" ]; then
  timeout 300 python3 tests/bench/gpu_fused_pre_one_format.py --out "$out/fused_pre_one_format.json" \
    > "$out/fused_pre_one_format.log" 2>&1
  step "fused pre-attention, one format A/B" $?; tail -n 10 "$out/fused_pre_one_format.log"
  python3 tests/bench/inductor_rounding.py --device cuda >> "$out/fused_pre_one_format.log" 2>&1
  step "Inductor's rounding" $?; tail -n 9 "$out/fused_pre_one_format.log"
fi
if [ -n "${PRE_AB:-}" ]; then
  PARITY_FUSED_SAMPLER=${fused:-off} timeout 400 python3 tests/bench/gpu_int4_decode_variants.py --pre-ab \
    --out "$out/pre_ab.json" > "$out/pre_ab.log" 2>&1
  step "fused pre-attention on and off (PARITY_FUSED_SAMPLER=${fused:-off})" $?; grep "pre-attention" "$out/pre_ab.log" | tail -n 1
fi
if [ -n "${READ_CEILING:-}" ]; then
  timeout 300 python3 tests/bench/gpu_read_ceiling.py --out "$out/read_ceiling.json" > "$out/read_ceiling.log" 2>&1
  step "read ceiling" $?; tail -n 1 "$out/read_ceiling.log"
fi
touch "$out/job.done"
