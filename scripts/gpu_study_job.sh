#!/usr/bin/env bash
# One job of the GPU study on a CUDA machine without the project's environment (docs/study/grpo_study.md,
# "Reproducing"): the pure-Python packages travel in .gpucarry/site (hydra, omegaconf, antlr4, math_verify,
# latex2sympy2_extended with their dist-info, copied from .venv). The warm start (PREPARE_EXTRA: overrides of its
# own, e.g. model.warm_start.seed=3 for one seed's part) is built in the job, or restored from the pieces in
# WARM_IMPORT (a folder of warm.tar.part* or of the packed warm.tar.xz.part*; scripts/warm_start_pieces.py); WARM_EXPORT=1 rounds a freshly built one to
# bfloat16 and writes its pieces to $OUT, so later jobs start from the same weights. With THROUGHPUT_OLD (an earlier
# tree's platform/ folder) the study-throughput bench runs first, old code against this tree's, from that warm start
# (tests/bench/gpu_study_throughput.py; THROUGHPUT_STEPS, default 20; THROUGHPUT_ARGS, more of its options such as
# --env, split at spaces; THROUGHPUT_NEW_EXTRA, the overrides of its --new-extra, one argument), and with
# STUDY_MIN_RATIO the job ends there
# unless the new code ran at least that many times faster (a study part that cannot finish in time is not begun). Then the CUDA MPS daemon is started where the
# image has it (the runs' kernels side by side instead of time-sliced; parity.study.mps) and each STUDY argument
# runs as its own `python -m parity study` process, all at once, cut at JOB_SECONDS from the job's start; what
# finished and the partial runs are collected into study.json, and the run folders (metrics, summaries), the study
# folders and the logs are packed into $OUT/runs.tgz, to be read back with the runs of other jobs by
# `python -m parity study --collect`. The job touches $OUT/job.done when it ends.
# AFTER_PREPARE: a shell command run once the warm start is there (MODEL holds its folder), before the bench, its
# output in $OUT/after_prepare.log (e.g. the CUDA tests, or a bench that needs the trained model).
# WARM_SEEDS="3 4" also builds those seeds' warm starts beside the job's own (each its own process, at once) and
# writes their pieces to $OUT/warm_seed<S>/, for later jobs' WARM_IMPORT: one job's first minutes build every
# warm start the later jobs need.
#   usage: [PREPARE_EXTRA=...] [AFTER_PREPARE=CMD] [WARM_IMPORT=DIR] [WARM_EXPORT=1] [WARM_SEEDS="S ..."] [THROUGHPUT_OLD=DIR] \
#          scripts/gpu_study_job.sh JOB_SECONDS PRESET "STUDY ARGS" [...]
set -u
budget=$1; preset=$2; shift 2
# The job runs from its own copy of the tree (the carried .gpucarry with it): a later call to the machine copies the
# working tree afresh and drops a carried folder it does not name again, which would pull packages from under
# processes still starting. Paths into the tree given in WARM_IMPORT or THROUGHPUT_OLD follow the copy.
orig=$PWD; copy=$(mktemp -d /tmp/parity-job.XXXXXX)/tree
cp -r "$orig" "$copy" && cd "$copy" || { echo "could not copy the tree to $copy"; exit 1; }
[ -n "${WARM_IMPORT:-}" ] && WARM_IMPORT=${WARM_IMPORT/#$orig/$copy}
[ -n "${THROUGHPUT_OLD:-}" ] && THROUGHPUT_OLD=${THROUGHPUT_OLD/#$orig/$copy}
export PYTHONPATH=$PWD/platform:$PWD/.gpucarry/site PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
out=${OUT:-/tmp/out}; po=/tmp/po; logs=$po/joblogs; mkdir -p "$out" $logs
t0=$(date +%s)
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
if [ -n "${WARM_IMPORT:-}" ]; then python3 scripts/warm_start_pieces.py import "$WARM_IMPORT" $po/models; fi
base=$(python3 -c "from parity.study.presets import PRESETS; p=PRESETS['$preset']; print(' '.join(['experiment='+p.experiment, *p.base]))")
warm_pids=()
for s in ${WARM_SEEDS:-}; do
  ( python3 -m parity prepare outputs_dir=$po/warm$s $base model.warm_start.seed=$s > $logs/prepare_seed$s.log 2>&1 \
      && d=$(tail -n 1 $logs/prepare_seed$s.log | python3 -c "import json,sys; print(json.load(sys.stdin)['model_dir'])") \
      && python3 scripts/warm_start_pieces.py export "$d" "$out/warm_seed$s"
  ) > $logs/warm_seed$s.log 2>&1 &
  warm_pids+=($!)
done
python3 -m parity prepare outputs_dir=$po $base ${PREPARE_EXTRA:-} > $logs/prepare.log 2>&1
tail -n 1 $logs/prepare.log | tee "$out/prepare.json"
model_dir=$(python3 -c "import json; print(json.load(open('$out/prepare.json'))['model_dir'])")
if [ -n "${WARM_EXPORT:-}" ]; then python3 scripts/warm_start_pieces.py export "$model_dir" "$out"; fi
echo "prepare: $(( $(date +%s) - t0 )) s"
for p in "${warm_pids[@]}"; do wait "$p" || echo "a warm start of WARM_SEEDS failed: see $logs/prepare_seed*.log"; done
[ -n "${WARM_SEEDS:-}" ] && echo "warm starts of seeds ${WARM_SEEDS}: $(( $(date +%s) - t0 )) s" && ls "$out"/warm_seed*
if [ -n "${AFTER_PREPARE:-}" ]; then  # checks that need the warm start, before the bench (MODEL: its folder)
  ( export MODEL="$model_dir"; eval "$AFTER_PREPARE" ) > "$out/after_prepare.log" 2>&1
  echo "after prepare (exit $?): $(( $(date +%s) - t0 )) s"; tail -n 5 "$out/after_prepare.log"
fi
if [ -n "${THROUGHPUT_OLD:-}" ]; then
  python3 tests/bench/gpu_study_throughput.py --old "$THROUGHPUT_OLD" --model-dir "$model_dir" --preset "$preset" \
      --steps "${THROUGHPUT_STEPS:-20}" --eval-every 10 --old-commit "${THROUGHPUT_OLD_COMMIT:-}" \
      --out "$out/study_throughput.json" ${THROUGHPUT_ARGS:-} ${THROUGHPUT_NEW_EXTRA:+--new-extra "$THROUGHPUT_NEW_EXTRA"} \
      2>&1 | tee $logs/throughput.log
  echo "throughput: $(( $(date +%s) - t0 )) s"
  if [ -n "${STUDY_MIN_RATIO:-}" ] && ! python3 -c "import json,sys; sys.exit(json.load(open('$out/study_throughput.json')).get('ratio', 0) < $STUDY_MIN_RATIO)"; then
    echo "throughput ratio below $STUDY_MIN_RATIO: the study parts are not started"; touch "$out/job.done"; exit 0
  fi
fi
mps=0
if command -v nvidia-cuda-mps-control > /dev/null && [ "${MPS:-1}" = 1 ]; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps CUDA_MPS_LOG_DIRECTORY=/tmp/nvidia-mps-log
  mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
  nvidia-cuda-mps-control -d && mps=1 && echo "MPS daemon started"
fi
i=0; pids=()
for args in "$@"; do
  i=$((i + 1))
  eval "timeout $(( budget - ($(date +%s) - t0) )) python3 -m parity study --preset $preset --outputs-dir $po \\
      --out $po/study/job$i $args" > "$logs/study$i.log" 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
pkill -f "parity train" 2>/dev/null; sleep 2  # runs a study cut at the budget left behind
if [ $mps = 1 ]; then echo quit | nvidia-cuda-mps-control; fi
i=0
for args in "$@"; do
  i=$((i + 1))
  eval "python3 -m parity study --preset $preset --outputs-dir $po --out $po/study/job$i $args --collect" \
      > "$logs/collect$i.log" 2>&1
  cp "$po/study/job$i/study.json" "$out/study_job$i.json" 2>/dev/null
done
tar czf "$out/runs.tgz" -C $po --exclude='*.safetensors' --exclude='*.pt' runs study joblogs 2>/dev/null
echo "job: $(( $(date +%s) - t0 )) s"
tail -n 2 $logs/study*.log
touch "$out/job.done"
