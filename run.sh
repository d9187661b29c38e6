#!/usr/bin/env bash
# The main job: a DFlash2 draft for the embedded SmolLM2-135M-Instruct, trained on a 2-core CPU in
# about 30 minutes, ending with its held-out accepted lengths.
#
#   bash run.sh                 # DFlash2
#   bash run.sh --dflash        # the plain DFlash baseline on the same data and budget
#   bash run.sh --epochs 10     # any train.py flag; N_TRAIN=2000 bash run.sh for more data
#
# Steps 1 and 2 are resumable and skipped when already done, so a second run only trains.
set -euo pipefail
cd "$(dirname "$0")"
CFG=configs/smollm2-135m-dflash2.json
DATA=${DATA:-data/smollm2}
N_TRAIN=${N_TRAIN:-320}       # training prompts, answered by the target itself (on-policy data)
N_EVAL=${N_EVAL:-48}          # held-out prompts: MT-Bench, HumanEval, GSM8K interleaved
NAME=dflash2
for a in "$@"; do [ "$a" = --dflash ] && NAME=dflash; done

t0=$SECONDS
# 1. Regenerate the answers with the target (greedy) and capture its features at target_layer_ids.
python prepare.py --prompts default --num-samples "$N_TRAIN" --regenerate --max-new-tokens 160 \
    --features --draft-config "$CFG" --out-dir "$DATA/train"
python prepare.py --prompts eval --num-samples "$N_EVAL" --regenerate --max-new-tokens 160 \
    --features --draft-config "$CFG" --out-dir "$DATA/eval"
echo "[run.sh] prepare: $((SECONDS - t0)) s"; t0=$SECONDS
# 2. Train. bf16 autocast is about 3x faster than fp32 on this CPU; 64 anchors per sequence.
python train.py --draft-config "$CFG" --data "$DATA/train" --eval-data "$DATA/eval" --eval-samples "$N_EVAL" \
    --out-dir "out/smollm2-$NAME" --dtype bf16 --num-anchors 64 --epochs 3 --lr 1e-3 \
    --eval-interval 250 --save-interval 100 "$@"
echo "[run.sh] train: $((SECONDS - t0)) s"
# 3. Export the servable draft directory (config.json + model.safetensors).
python export.py "out/smollm2-$NAME" --out-dir "out/smollm2-$NAME/export"
