#!/usr/bin/env bash
# The first checks on a GPU machine, in one run (docs/gpu.md, docs/benchmarks.md), each under its own time limit,
# each log in OUT_DIR (default gpu_checks/):
#   0. the GPU-only tests (tests/test_flash_varlen.py: BERT's varlen flash kernels with dropout)
#   1. cluster_check on one node, synthetic data: BERT (config.yaml's recipe: LAMB) and ModernBERT-base
#      (StableAdamW, full-sentence rows): every fast path against its reference, then the real trainer's steps
#   2. benchmarks/train_step.py --gpu: BERT-large phase 1 and phase 2 steps, seq/s and MFU
#   3. benchmarks/modernbert_step.py --gpu at 1,024 and 8,192 tokens: ours against HF's ModernBertForMaskedLM, at
#      vocabularies of 8,192 and 50,368 (ModernBERT's)
#   4. (LEARNING=1) benchmarks/learning_parity.py --device cuda, each family, the texts in $TEXTS
#
#     bash benchmarks/gpu_checks.sh [OUT_DIR]
# Without a CUDA device every step says so and the script exits 0 (the Python benchmarks' own behaviour).
set -u
out=${1:-gpu_checks}
mkdir -p "$out"
py=${PYTHON:-python3}
limit=${STEP_LIMIT_S:-120}
work=$(mktemp -d)

step() {  # step NAME COMMAND...: run under the time limit, log to $out/NAME.log, print its tail
    local name=$1; shift
    local start=$SECONDS
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    echo "== $name: exit $? in $((SECONDS - start)) s"
    grep -v " INFO \|Warning\|warn(" "$out/$name.log" | tail -n "${TAIL:-12}"
}

config() {  # config FAMILY SECTIONS: the JSON a rule would hand over, from config.yaml
    "$py" - "$@" <<'EOF'
import json, sys, yaml
config = yaml.safe_load(open("config.yaml"))
family, sections = sys.argv[1], sys.argv[2].split(",")
if family == "modernbert":
    config["model"]["family"] = "modernbert"
    config["pretrain"]["optimizer"] = "stable_adamw"
    config["encode"].update(objective="full_sentences", masking="dynamic", dupe_factor=1)
print(json.dumps({key: config[key] for key in sections}))
EOF
}

"$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available() and torch.cuda.get_device_name())"
step gpu_tests "$py" -m pytest -q -p no:cacheprovider -o addopts="" tests/test_flash_varlen.py
for family in bert modernbert; do
    "$py" -m workflow.data.synthetic_shards --config "$(config $family seed,vocab,encode)" \
        --output-data "$work/$family/hdf5" --output-vocab "$work/$family/vocab.txt" \
        --training-instances "${CHECK_TRAINING:-40000}" --test-instances "${CHECK_TEST:-10000}" >"$out/data_$family.log" 2>&1
    step "cluster_check_$family" "$py" -m workflow.slurm.launch --run-dir "$work/run_$family" -- \
        "$py" -m workflow.slurm.cluster_check --config "$(config $family seed,model,pretrain)" \
        --data-dir "$work/$family/hdf5" --vocab "$work/$family/vocab.txt" --run-dir "$work/run_$family" \
        --output "$out/cluster_check_$family.json" --steps "${CHECK_STEPS:-10}"
done
step train_step "$py" benchmarks/train_step.py --gpu
for vocab in ${VOCABS:-8192 50368}; do  # the benchmark's default and ModernBERT's own
    step "modernbert_step_1024_$vocab" "$py" benchmarks/modernbert_step.py --gpu --gpu-seq 1024 --micro-batch 64 --vocab "$vocab"
    step "modernbert_step_8192_$vocab" "$py" benchmarks/modernbert_step.py --gpu --gpu-seq 8192 --micro-batch 8 --vocab "$vocab"
done
if [ "${LEARNING:-0}" = 1 ]; then
    for text in ${TEXTS:-python-docs wikipedia}; do
        for family in ${FAMILIES:-bert}; do
            limit=${LEARNING_LIMIT_S:-600} TAIL=40 step "learning_parity_${family}_$text" "$py" \
                benchmarks/learning_parity.py --device cuda --text "$text" $([ "$family" = bert ] || echo --family "$family") \
                --json "$out/learning_parity_${family}_$text.json" --png "$out/learning_parity_${family}_$text.png"
        done
    done
fi
rm -rf "$work"
exit 0
