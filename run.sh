#!/usr/bin/env bash
# The main job: a DFlash2 draft for the embedded SmolLM2-135M-Instruct, trained on a 2-core CPU in
# about 38 minutes, ending with its held-out accepted lengths.
#
#   bash run.sh                  # DFlash2 on the maths demo: school word problems, held out on GSM8K test
#   bash run.sh --dflash         # the plain DFlash baseline on the same data and budget
#   DOMAIN=general bash run.sh   # the general mix (chat, code, maths), held out on MT-Bench/HumanEval/GSM8K
#   bash run.sh --max-steps 4000 # any train.py flag; N_TRAIN=4800 bash run.sh for more data
#
# Step 1 resumes and skips what is done, so a second run only trains; --resume continues a stopped
# training (--steps-this-run N stops one after N steps). OUT=DIR trains into another folder.
set -euo pipefail
cd "$(dirname "$0")"
CFG=configs/smollm2-135m-dflash2.json
DOMAIN=${DOMAIN:-math}
N_TRAIN=${N_TRAIN:-2400}      # training prompts, answered by the target itself (on-policy data)
N_EVAL=${N_EVAL:-48}          # held-out prompts
case $DOMAIN in
    math) TRAIN_SET=math; EVAL_SET=math-eval ;;      # GSM8K test questions 1..48, never trained on
    general) TRAIN_SET=default; EVAL_SET=eval ;;     # MT-Bench, HumanEval, GSM8K interleaved
    *) echo "error: DOMAIN must be math or general, got $DOMAIN" >&2; exit 2 ;;
esac
DATA=${DATA:-data/smollm2-$DOMAIN}
NAME=dflash2
for a in "$@"; do
    [ "$a" = --dflash ] && NAME=dflash
    [ "$a" = --out-dir ] && { echo "error: run.sh: name the output folder with OUT=DIR bash run.sh, not --out-dir" >&2; exit 2; }
done
OUT=${OUT:-out/smollm2-$DOMAIN-$NAME}

t0=$SECONDS
# 1. The target answers the prompts (greedy, bf16: 2.6x faster than fp32 here, its weights packed for
#    oneDNN: 1.3x more) and its features are captured at target_layer_ids, with its final hidden state
#    for the kl loss.
PREP="--regenerate --max-new-tokens 160 --features --draft-config $CFG --target-dtype bf16 --batch-size 64"
python prepare.py --prompts $TRAIN_SET --num-samples "$N_TRAIN" $PREP --save-target-hidden --out-dir "$DATA/train"
python prepare.py --prompts $EVAL_SET --num-samples "$N_EVAL" $PREP --save-target-hidden --out-dir "$DATA/eval"
echo "[run.sh] prepare: $((SECONDS - t0)) s"; t0=$SECONDS
# 2. Train (the recipe study in README.md chose these flags). bf16 autocast is about 3x faster than fp32 here.
python train.py --draft-config "$CFG" --data "$DATA/train" --eval-data "$DATA/eval" --eval-samples "$N_EVAL" \
    --out-dir "$OUT" --dtype bf16 --num-anchors 32 --lr 1e-3 --epochs 2 \
    --eval-interval 600 --save-interval 300 "$@"
echo "[run.sh] train: $((SECONDS - t0)) s"
# 3. Export the servable draft directory (config.json + model.safetensors).
python export.py "$OUT" --out-dir "$OUT/export"
