#!/usr/bin/env bash
# One job of the GPU study on a CUDA machine without the project's environment (docs/study/collapse_study.md):
# the pure-Python packages travel in .gpucarry/site (hydra, omegaconf, antlr4, math_verify, latex2sympy2_extended
# with their dist-info, copied from .venv), the warm start is built in the job (deterministic kernels; its hash is
# in prepare.json), then each STUDY line runs as its own `python -m parity study` process, all at once, cut at
# JOB_SECONDS; whatever finished and the partial runs are collected into study.json, and the run folders (metrics,
# summaries) are packed into $OUT/runs.tgz so that later jobs' runs and these are read back together by
# `python -m parity study --collect`.
#   usage: scripts/gpu_study_job.sh JOB_SECONDS PRESET "STUDY ARGS" ["STUDY ARGS" ...]
set -u
budget=$1; preset=$2; shift 2
export PYTHONPATH=$PWD/platform:$PWD/.gpucarry/site PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
out=${OUT:-/tmp/out}; po=/tmp/po; mkdir -p "$out" $po
t0=$(date +%s)
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
base=$(python3 -c "from parity.study.presets import PRESETS; p=PRESETS['$preset']; print(' '.join(['experiment='+p.experiment, *p.base]))")
python3 -m parity prepare outputs_dir=$po $base 2>&1 | tail -3 | tee "$out/prepare.txt"
echo "prepare: $(( $(date +%s) - t0 )) s"
i=0; pids=()
for args in "$@"; do
  i=$((i + 1))
  eval "timeout $(( budget - ($(date +%s) - t0) )) python3 -m parity study --preset $preset --outputs-dir $po \
      --out $po/study/job$i $args" > "$out/study$i.log" 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
pkill -f "parity train" 2>/dev/null; sleep 2  # runs a study cut at the budget left behind
i=0
for args in "$@"; do
  i=$((i + 1))
  eval "python3 -m parity study --preset $preset --outputs-dir $po --out $po/study/job$i $args --collect" \
      > "$out/collect$i.log" 2>&1
  cp $po/study/job$i/study.json "$out/study$i.json" 2>/dev/null
done
tar czf "$out/runs.tgz" -C $po --exclude='*.safetensors' --exclude='*.pt' runs study 2>/dev/null
echo "job: $(( $(date +%s) - t0 )) s"
tail -n 3 "$out"/study*.log
