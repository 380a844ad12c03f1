#!/usr/bin/env bash
# One job of the GPU study on a CUDA machine without the project's environment (docs/study/grpo_study.md,
# "Reproducing"): the pure-Python packages travel in .gpucarry/site (hydra, omegaconf, antlr4, math_verify,
# latex2sympy2_extended with their dist-info, copied from .venv). The warm start is built in the job, or restored
# from the pieces in WARM_IMPORT (a folder of warm.tar.part*; scripts/warm_start_pieces.py); WARM_EXPORT=1 rounds
# a freshly built one to bfloat16 and writes its pieces to $OUT, so later jobs start from the same weights. Then
# each STUDY argument runs as its own `python -m parity study` process, all at once, cut at JOB_SECONDS from the
# job's start; what finished and the partial runs are collected into study.json, and the run folders (metrics,
# summaries), the study folders and the logs are packed into $OUT/runs.tgz, to be read back with the runs of
# other jobs by `python -m parity study --collect`.
#   usage: [WARM_IMPORT=DIR] [WARM_EXPORT=1] scripts/gpu_study_job.sh JOB_SECONDS PRESET "STUDY ARGS" [...]
set -u
budget=$1; preset=$2; shift 2
export PYTHONPATH=$PWD/platform:$PWD/.gpucarry/site PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
out=${OUT:-/tmp/out}; po=/tmp/po; logs=$po/joblogs; mkdir -p "$out" $logs
t0=$(date +%s)
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
if [ -n "${WARM_IMPORT:-}" ]; then python3 scripts/warm_start_pieces.py import "$WARM_IMPORT" $po/models; fi
base=$(python3 -c "from parity.study.presets import PRESETS; p=PRESETS['$preset']; print(' '.join(['experiment='+p.experiment, *p.base]))")
python3 -m parity prepare outputs_dir=$po $base > $logs/prepare.log 2>&1
tail -n 1 $logs/prepare.log | tee "$out/prepare.json"
if [ -n "${WARM_EXPORT:-}" ]; then
  python3 scripts/warm_start_pieces.py export "$(python3 -c "import json,sys; print(json.load(open('$out/prepare.json'))['model_dir'])")" "$out"
fi
echo "prepare: $(( $(date +%s) - t0 )) s"
i=0; pids=()
for args in "$@"; do
  i=$((i + 1))
  eval "timeout $(( budget - ($(date +%s) - t0) )) python3 -m parity study --preset $preset --outputs-dir $po \\
      --out $po/study/job$i $args" > "$logs/study$i.log" 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
pkill -f "parity train" 2>/dev/null; sleep 2  # runs a study cut at the budget left behind
i=0
for args in "$@"; do
  i=$((i + 1))
  eval "python3 -m parity study --preset $preset --outputs-dir $po --out $po/study/job$i $args --collect" \
      > "$logs/collect$i.log" 2>&1
done
tar czf "$out/runs.tgz" -C $po --exclude='*.safetensors' --exclude='*.pt' runs study joblogs 2>/dev/null
echo "job: $(( $(date +%s) - t0 )) s"
tail -n 2 $logs/study*.log
