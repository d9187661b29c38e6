#!/usr/bin/env bash
# The main job: a DFlash2 draft for the embedded SmolLM2-135M-Instruct, trained on a 2-core CPU within
# BUDGET_MIN minutes (default 45), ending with its held-out accepted lengths: teacher-forced at random
# anchors, and served (16 held-out prompts decoded by the real loop, served.py), side by side.
#
#   bash run.sh                  # DFlash2 on the maths demo: school word problems, held out on GSM8K test
#   bash run.sh --dflash         # the plain DFlash baseline on the same data and budget
#   DOMAIN=general bash run.sh   # the general mix (chat, code, maths), held out on MT-Bench/HumanEval/GSM8K
#   bash run.sh --max-steps 4000 # any train.py flag; N_TRAIN=4800 bash run.sh for more data
#   BUDGET_MIN=90 bash run.sh    # a longer budget: plan.py sizes the answers to it (N_TRAIN wins)
#
# Step 0 measures this machine for about a minute and sizes the job to the budget (tools/plan.py): on a 2-core
# CPU about 1,500 of the recipe's 2,400 answers where bf16 is native, 600 without it. Every precision and
# GEMM layout is `auto`: speed/machine.py picks them per CPU and each script prints what it chose.
# Step 1 resumes and skips what is done, so a second run only trains; --resume continues a stopped
# training (--steps-this-run N stops one after N steps). OUT=DIR trains into another folder.
set -euo pipefail
cd "$(dirname "$0")"
CFG=configs/smollm2-135m-dflash2.json
DOMAIN=${DOMAIN:-math}
BUDGET_MIN=${BUDGET_MIN:-45}  # the whole job, in minutes
N_EVAL=${N_EVAL:-48}          # held-out prompts
case $DOMAIN in
    math) TRAIN_SET=math; EVAL_SET=math-eval ;;      # GSM8K test questions 1..48, never trained on
    general) TRAIN_SET=default; EVAL_SET=eval ;;     # MT-Bench, HumanEval, GSM8K interleaved
    *) echo "error: DOMAIN must be math or general, got $DOMAIN" >&2; exit 2 ;;
esac
DATA=${DATA:-data/smollm2-$DOMAIN}
NAME=dflash2
PLAN=(--budget-min "$BUDGET_MIN" --data "$DATA/train" --draft-config "$CFG")
[ -n "${N_TRAIN:-}" ] && PLAN+=(--num-samples "$N_TRAIN")
prev=
for a in "$@"; do
    [ "$a" = --dflash ] && { NAME=dflash; PLAN+=(--dflash); }
    [ "$prev" = --epochs ] && PLAN+=(--epochs "$a")
    [ "$a" = --out-dir ] && { echo "error: run.sh: name the output folder with OUT=DIR bash run.sh, not --out-dir" >&2; exit 2; }
    prev=$a
done
OUT=${OUT:-out/smollm2-$DOMAIN-$NAME}

start=$SECONDS t0=$SECONDS
# 0. The plan: how many training prompts (answered by the target itself: on-policy data) fit the budget.
N_TRAIN=$(python tools/plan.py "${PLAN[@]}" | sed -n 's/^N_TRAIN=//p')
echo "[run.sh] plan: $((SECONDS - t0)) s, $N_TRAIN answers"; t0=$SECONDS
# 1. The target answers the prompts (greedy; in bf16 with oneDNN's packed weights where bf16 is native, else fp32)
#    and its features are captured at target_layer_ids, with its final hidden state for the kl loss.
PREP="--regenerate --max-new-tokens 160 --features --draft-config $CFG --batch-size 64"
python prepare.py --prompts $TRAIN_SET --num-samples "$N_TRAIN" $PREP --save-target-hidden --out-dir "$DATA/train"
python prepare.py --prompts $EVAL_SET --num-samples "$N_EVAL" $PREP --save-target-hidden --out-dir "$DATA/eval"
echo "[run.sh] prepare: $((SECONDS - t0)) s"; t0=$SECONDS
# 2. Train (the recipe study in README.md chose these flags), in bf16 autocast where bf16 is native.
python train.py --draft-config "$CFG" --data "$DATA/train" --eval-data "$DATA/eval" --eval-samples "$N_EVAL" \
    --out-dir "$OUT" --num-anchors 32 --lr 1e-3 --epochs 2 \
    --eval-interval 600 --save-interval 300 "$@"
echo "[run.sh] train: $((SECONDS - t0)) s"; t0=$SECONDS
# 3. Served tau: 16 held-out prompts decoded by the real loop (with speed/tune.py's fast path), once the
#    training has finished: its final record then closes the log (--steps-this-run stops it before).
if tail -n 1 "$OUT/log.jsonl" | grep -q '"kind": "final"'; then
    python served.py "$OUT" --fast
    echo "[run.sh] served: $((SECONDS - t0)) s"
fi
# 4. Export the servable draft directory (config.json + model.safetensors).
python export.py "$OUT" --out-dir "$OUT/export"
echo "[run.sh] the job: $(((SECONDS - start) / 60)) min $(((SECONDS - start) % 60)) s (budget $BUDGET_MIN min)"
