#!/usr/bin/env bash
# The first checks on a GPU machine, in one run (docs/gpu.md, docs/benchmarks.md), each a `step` under its own time
# limit with its own log in OUT_DIR (default gpu_checks/), then a verdict: a Markdown table
# `| step | result | seconds | log |` and exit status 1 when any step failed (a timeout is a failure, named so).
#   gpu_tests                     the GPU-only tests (tests/test_flash_varlen.py: BERT's varlen flash kernels, dropout)
#   data_FAMILY                   synthetic shards for the check below (checked non-empty before it runs)
#   cluster_check_FAMILY          cluster_check on one node: BERT (config.yaml's recipe: LAMB) and ModernBERT-base
#                                 (StableAdamW, full-sentence rows): every fast path against its reference, the trainer
#   train_step_PHASE              benchmarks/train_step.py --gpu: BERT-large phase 1 (128) and 2 (512), HF beside ours
#                                 eager, compiled, compiled + float8: real tokens/s, MFU, peak memory, largest
#                                 micro-batch (HF and eager), LAMB per global batch
#   modernbert_step_SEQ_VOCAB     benchmarks/modernbert_step.py --gpu: ModernBERT-base at 1,024 and 8,192 tokens, vocab
#                                 50,368, the same variants and figures, StableAdamW per global batch
#   learning_parity_FAMILY_TEXT   (LEARNING=1) benchmarks/learning_parity.py --device cuda on the texts in $TEXTS
# PARTS (default "speed checks", in that order) picks and orders the parts: `speed` the step benchmarks, `checks` the
# GPU tests and cluster checks; the learning runs follow with LEARNING=1. Each row of the verdict is also appended to
# OUT_DIR/verdict.md as its step ends, so a run stopped from outside keeps the rows of the steps it finished.
# Wheels: on a GPU machine, the wheels in WHEELS (default .whl; benchmarks/gpu_wheels.sh downloads them where an index
# can be reached) are installed into a directory of the run, put first on PYTHONPATH, before any step.
#
#     bash benchmarks/gpu_checks.sh [OUT_DIR]
#     GPU_CHECKS_CPU=1 bash benchmarks/gpu_checks.sh    a rehearsal on CPU: the same steps at tiny sizes (the
#                                                       benchmarks on tiny models, their GPU code path), the
#                                                       GPU-only ones "skipped (no GPU)"
#     GPU_CHECKS_STEPS=FILE ...                         the steps FILE declares (bash, `step` lines) instead of these
# A new check is one more `step NAME LIMIT_S COMMAND...` line in gpu_steps (or `gpu_step` for a GPU-only one).
# Device time: the whole run is meant to take ~12 minutes on one H200: each step's comment says its expected time
# there (speed ~2 x 120 + 2 x 100 s, checks ~40 + 2 x 115 s), its limit stops one that runs long. Where one command
# may run 10 minutes at most, run PARTS=speed and PARTS=checks as two. Expected times are estimates until a run's
# verdict table gives the seconds.
set -u
out=${1:-gpu_checks}
mkdir -p "$out"
printf '| step | result | seconds | log |\n|---|---|---|---|\n' >"$out/verdict.md"
py=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
rows=()
failed=0
cpu=${GPU_CHECKS_CPU:-0}

record() {  # record NAME RESULT SECONDS LOG: one row of the verdict (also appended to $out/verdict.md)
    rows+=("| $1 | $2 | $3 | $4 |")
    echo "| $1 | $2 | $3 | $4 |" >>"$out/verdict.md"
    case $2 in failed*) failed=1 ;; esac
    echo "== $1: $2 in $3 s"
}

step() {  # step NAME LIMIT_S COMMAND...: run COMMAND under LIMIT_S seconds, log to $out/NAME.log, print its tail
    local name=$1 limit=$2 start=$SECONDS status result
    shift 2
    timeout --kill-after=30 "$limit" "$@" >"$out/$name.log" 2>&1
    status=$?
    case $status in
        0) result=passed ;;
        124 | 137) result="failed (timeout after $limit s)" ;;
        *) result="failed (exit $status)" ;;
    esac
    record "$name" "$result" $((SECONDS - start)) "$out/$name.log"
    grep -v " INFO \|Warning\|warn(" "$out/$name.log" | tail -n "${TAIL:-12}"
}

gpu_step() {  # gpu_step NAME LIMIT_S COMMAND...: a step that needs a GPU (skipped in the CPU rehearsal)
    if [ "$cpu" = 1 ]; then record "$1" "skipped (no GPU)" 0 -; else step "$@"; fi
}

made() {  # made NAME PATH...: each PATH is a non-empty file or a directory holding one; else NAME fails, saying so
    local name=$1 path
    shift
    for path; do
        if [ -z "$(find "$path" -type f -size +0c 2>/dev/null | head -n 1)" ]; then
            record "$name" "failed (no synthetic data: $path is missing or empty)" 0 -
            return 1
        fi
    done
}

config() {  # config FAMILY SECTIONS: the JSON a rule would hand over, from config.yaml (tiny models in the rehearsal)
    "$py" - "$@" <<'EOF'
import json, os, sys, yaml
config = yaml.safe_load(open("config.yaml"))
family, sections = sys.argv[1], sys.argv[2].split(",")
if family == "modernbert":
    config["model"]["family"] = "modernbert"
    config["pretrain"]["optimizer"] = "stable_adamw"
    config["encode"].update(objective="full_sentences", masking="dynamic", dupe_factor=1)
if os.environ.get("GPU_CHECKS_CPU") == "1":
    config["model"]["preset"] = "tiny" if family == "bert" else "modernbert-tiny"
print(json.dumps({key: config[key] for key in sections}))
EOF
}

cluster_check() {  # cluster_check FAMILY: its synthetic data (~15 s), then the check on them
    local family=$1 data=$work/$1
    step "data_$family" 120 "$py" -m workflow.data.synthetic_shards --config "$(config "$family" seed,vocab,encode)" \
        --output-data "$data/hdf5" --output-vocab "$data/vocab.txt" \
        --training-instances "$training" --test-instances "$test"
    made "cluster_check_$family" "$data/hdf5" "$data/vocab.txt" || return
    # ~100 s each on one H200 (BERT-large took > 80 s: one rank, 10 steps); on 8 ranks raise CHECK_LIMIT_S
    step "cluster_check_$family" "${CHECK_LIMIT_S:-240}" \
        "$py" -m workflow.slurm.launch --run-dir "$work/run_$family" -- \
        "$py" -m workflow.slurm.cluster_check --config "$(config "$family" seed,model,pretrain)" \
        --data-dir "$data/hdf5" --vocab "$data/vocab.txt" --run-dir "$work/run_$family" \
        --output "$out/cluster_check_$family.json" --steps "$steps"
}

benchmark_steps() {  # the GPU step benchmarks; in the rehearsal tiny models on CPU through the same code
    local size
    # HF and eager searched for the largest micro-batch: a compiled variant recompiles at each size (`all` does it)
    local measure=(--compile --float8 --find-max-micro-batch hf,eager)
    if [ "$cpu" = 1 ]; then
        measure+=(--device cpu --threads 1 --steps 1 --warmup 0 --optimizer-repeats 1 --max-micro-batch-cap 8)
    else
        measure+=(--steps 5 --warmup 1 --optimizer-repeats 3)
    fi
    for phase in phase1 phase2; do
        # ~120 s each on an H200: two compilations of BERT-large (~40 s each), the search (~20 s), LAMB (~15 s)
        size=()
        [ "$cpu" = 1 ] && size=(--preset tiny --vocab 1024 --gpu-micro-batch1 8 --gpu-micro-batch2 4)
        TAIL=20 step "train_step_$phase" "${BENCH_LIMIT_S:-200}" "$py" benchmarks/train_step.py --gpu \
            --phases "$phase" "${measure[@]}" "${size[@]}"
    done
    for vocab in ${VOCABS:-50368}; do  # ModernBERT's own vocabulary
        for seq_rows in 1024:64 8192:8; do
            # ~100 s each on an H200: two compilations of ModernBERT-base (~35 s each), HF's two sides, the search
            if [ "$cpu" = 1 ]; then
                size=(--preset modernbert-tiny --gpu-seq $((${seq_rows%:*} / 16)) --micro-batch 2)
            else
                size=(--gpu-seq "${seq_rows%:*}" --micro-batch "${seq_rows#*:}")
            fi
            TAIL=20 step "modernbert_step_${seq_rows%:*}_$vocab" "${BENCH_LIMIT_S:-180}" "$py" \
                benchmarks/modernbert_step.py --gpu --vocab "$vocab" "${measure[@]}" "${size[@]}"
        done
    done
}

install_wheels() {  # the wheels in $WHEELS (GPU only: they are built for the GPU machine's Python)
    local wheels=${WHEELS:-.whl}
    [ "$cpu" != 1 ] && compgen -G "$wheels/*.whl" >/dev/null || return 0
    "$py" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --target "$work/site" \
        "$wheels"/*.whl || { echo "error: gpu_checks: the wheels in $wheels did not install" >&2; exit 2; }
    export PYTHONPATH="$work/site${PYTHONPATH:+:$PYTHONPATH}"
    echo "installed: $(cd "$wheels" && echo *.whl)"
}

check_steps() {  # the GPU tests and the cluster checks
    if [ "$cpu" = 1 ]; then
        training=${CHECK_TRAINING:-2000} test=${CHECK_TEST:-500} steps=${CHECK_STEPS:-2}
    else
        training=${CHECK_TRAINING:-40000} test=${CHECK_TEST:-10000} steps=${CHECK_STEPS:-10}
    fi
    # ~40 s: the flash kernels' tests
    gpu_step gpu_tests 120 "$py" -m pytest -q -p no:cacheprovider -o addopts="" tests/test_flash_varlen.py
    for family in ${FAMILIES:-bert modernbert}; do
        cluster_check "$family"
    done
}

gpu_steps() {  # the checks, in order
    local part parts=${PARTS:-speed checks}
    for part in $parts; do
        case $part in
            speed | checks) ;;
            *) echo "error: gpu_checks: PARTS: unknown part '$part' (speed, checks)" >&2; exit 2 ;;
        esac
    done
    install_wheels
    "$py" -c "import torch; print('torch', torch.__version__, 'cuda',
                                  torch.cuda.is_available() and torch.cuda.get_device_name())"
    for part in $parts; do
        if [ "$part" = speed ]; then benchmark_steps; else check_steps; fi
    done
    if [ "${LEARNING:-0}" = 1 ]; then
        for text in ${TEXTS:-python-docs wikipedia}; do
            for family in ${FAMILIES:-bert}; do
                TAIL=40 gpu_step "learning_parity_${family}_$text" "${LEARNING_LIMIT_S:-1800}" "$py" \
                    benchmarks/learning_parity.py --device cuda --text "$text" \
                    $([ "$family" = bert ] || echo --family "$family") \
                    --json "$out/learning_parity_${family}_$text.json" --png "$out/learning_parity_${family}_$text.png"
            done
        done
    fi
}

verdict() {  # the table of every step; the exit status: 1 when one failed
    echo
    echo "| step | result | seconds | log |"
    echo "|---|---|---|---|"
    printf '%s\n' "${rows[@]}"
    exit "$failed"
}

if [ -n "${GPU_CHECKS_STEPS:-}" ]; then
    # shellcheck source=/dev/null
    source "$GPU_CHECKS_STEPS"
elif [ "$cpu" != 1 ] && ! "$py" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
    echo "error: gpu_checks: no CUDA device here; GPU_CHECKS_CPU=1 rehearses the steps on CPU at tiny sizes" >&2
    exit 2
else
    gpu_steps
fi
verdict
