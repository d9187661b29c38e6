#!/usr/bin/env bash
# The main job: a DFlash2 draft for the embedded SmolLM2-135M-Instruct, trained on a 2-core CPU in
# BUDGET_MIN minutes (default 45), ending with its held-out accepted length (tau).
#   bash run.sh                  # the maths demo: school word problems, held out on GSM8K test
#   bash run.sh --dflash         # the plain DFlash baseline on the same data and budget
#   DOMAIN=general bash run.sh   # the general mix, held out on MT-Bench, HumanEval and GSM8K
#   bash run.sh --lr 5e-4        # any train.py flag; --epochs or --max-steps fix the steps
#   N_TRAIN=800 bash run.sh      # that many answers, not those that fit; OUT=DIR trains elsewhere
#   bash run.sh --toy            # a toy target, the whole pipeline in minutes (configs/toy.flags)
#   bash run.sh --toy --loss kl  # any train.py flag too; --dflash trains into OUT/draft-dflash
# By budget, not prediction: each phase has a fixed share of the budget and stops itself there
# (docs/cpu.md, "The budget"): the 48 held-out answers; training answers for 55% of the time from
# there to training's end, 10% of the budget and a minute before the end; export; served tau until
# a minute before the end. A rerun keeps finished data and resumes stopped answering; --resume
# continues a stopped training. train.py's flags are checked before any work: a wrong one ends the
# job in one line `error: ...`.
set -euo pipefail
cd "$(dirname "$0")"
flags() { sed -n "s/^$2: //p" "configs/$1.flags"; }  # a recipe's flags for a script
check() {  # parse train.py's flags as given here, run.sh's then the user's, with train.py's parser
    python -c 'import sys, train; from support.common import flags_checked, run
run(lambda: flags_checked(train.parse_args, sys.argv[1:], "train.py"))' "$@"
}
case " $* " in *" --help "* | *" -h "*) exec python train.py --help ;; esac  # train.py's flags
TOY=
if [ "${1:-}" = --toy ]; then TOY=1; shift; fi  # then "$@" holds train.py's flags alone
DFLASH= FIT=1  # what run.sh reads from train.py's flags
for a in "$@"; do case $a in
    --dflash) DFLASH=1 ;;
    --epochs | --max-steps) FIT= ;;
    --out-dir | --out-dir=*)
        echo "error: run.sh: name the output folder with OUT=DIR, not --out-dir" >&2; exit 2 ;;
esac; done
if [ -n "$TOY" ]; then  # the toy: its target is made once (tools/toy_target.py), then reused
    start=$SECONDS OUT=${OUT:-out/toy} NAME=DFlash2 DRAFT=$OUT/draft
    [ -n "$DFLASH" ] && NAME=DFlash DRAFT=$OUT/draft-dflash
    read -ra PREP <<< "$(flags toy prepare) --draft-config configs/toy-dflash2.json"
    read -ra TRAIN <<< "$(flags toy train) --draft-config configs/toy-dflash2.json"
    TRAIN+=(--target "$OUT/target" --data "$OUT/data/train" --epochs 8 --eval-data "$OUT/data/eval")
    TRAIN+=(--eval-samples 32 --eval-interval 100 --quiet --out-dir "$DRAFT" "$@")
    check "${TRAIN[@]}"
    echo "[run.sh --toy] the $NAME draft into $DRAFT${*:+, with train.py $*}"
    [ -d "$OUT/target" ] || python -m tools.toy_target "$OUT/target"
    for part in "toy train 600" "toy-eval eval 32"; do read -r prompts dir n <<< "$part"
        python prepare.py --target "$OUT/target" --prompts "$prompts" --num-samples "$n" \
            "${PREP[@]}" --out-dir "$OUT/data/$dir"; done
    python train.py "${TRAIN[@]}"
    python -m tools.served "$DRAFT" --samples 32
    python export.py "$DRAFT" --out-dir "$DRAFT/export"
    # a held-out problem (neither the target nor the draft trained on it), decoded both ways
    python generate.py --target "$OUT/target" --draft "$DRAFT/export" --compare --show \
        --prompt "$(python -m prompts.toy_problems -3)" --show-svg "$DRAFT/decode.svg"
    python -m tools.plot "$DRAFT" --labels "$NAME"  # $DRAFT/training.svg
    echo "[run.sh --toy] pictures: $DRAFT/decode.svg $DRAFT/training.svg; $((SECONDS - start)) s"
    exit 0
fi

DOMAIN=${DOMAIN:-math} BUDGET_S=$((${BUDGET_MIN:-45} * 60)) N_EVAL=${N_EVAL:-48} NAME=dflash2
case $DOMAIN in
    math) TRAIN_SET=math EVAL_SET=math-eval ;;  # GSM8K test questions 1..48, never trained on
    general) TRAIN_SET=default EVAL_SET=eval ;; # MT-Bench, HumanEval, GSM8K interleaved
    *) echo "error: DOMAIN must be math or general, got $DOMAIN" >&2; exit 2 ;;
esac
[ -n "$DFLASH" ] && NAME=dflash
CFG=configs/smollm2-135m-dflash2.json DATA=${DATA:-data/smollm2-$DOMAIN} OUT=${OUT:-out/smollm2-$DOMAIN-$NAME}
read -ra TRAIN <<< "$(flags main train)"  # configs/main.flags: the recipe
TRAIN+=(--draft-config "$CFG" --data "$DATA/train" --eval-data "$DATA/eval" --eval-samples "$N_EVAL")
TRAIN+=(--out-dir "$OUT" --eval-interval 500 --save-interval 300)
TRAIN+=(--compile auto)  # then --max-seconds, then the user's flags
check "${TRAIN[@]}" "$@"
echo "[run.sh] the $NAME draft into $OUT${*:+, with train.py $*}"
start=$SECONDS
TRAIN_END=$((BUDGET_S * 9 / 10 - 60)) SERVED_END=$((BUDGET_S - 60))  # seconds into the job
left() {  # the seconds until $1 seconds into the job, for phase $2; none left is an error
    local s=$(($1 - (SECONDS - start)))
    [ $s -gt 0 ] || { echo "error: run.sh: BUDGET_MIN=$((BUDGET_S / 60)) leaves no time for $2" >&2; exit 2; }
    echo $s
}
phase() { echo "[run.sh] $1: $((SECONDS - t0)) s"; t0=$SECONDS; }
t0=$SECONDS

# 1. The target answers the prompts, its features captured at the draft's target_layer_ids with its
#    final hidden state (the kl loss reads it); bf16 where the CPU has it natively.
PREP=(--regenerate --max-new-tokens 160 --features --draft-config "$CFG" --batch-size 64 --save-target-hidden)
python prepare.py --prompts "$EVAL_SET" --num-samples "$N_EVAL" "${PREP[@]}" --out-dir "$DATA/eval"
phase "held-out set ($N_EVAL)"
if [ -n "${N_TRAIN:-}" ]; then
    python prepare.py --prompts "$TRAIN_SET" --num-samples "$N_TRAIN" "${PREP[@]}" --out-dir "$DATA/train"
elif [ ! -f "$DATA/train/manifest.json" ]; then
    S=$(left $(((SECONDS - start) + (TRAIN_END - (SECONDS - start)) * 55 / 100)) answers)
    python prepare.py --prompts "$TRAIN_SET" --max-seconds "$S" "${PREP[@]}" --out-dir "$DATA/train"
fi
phase answers

# 2. Train (the recipe study in README.md chose these flags) for the time left but the served share,
#    compiled where that pays on this CPU (docs/cpu.md; train.py's first line says which).
[ -n "$FIT" ] && S=$(left $TRAIN_END training)
python train.py "${TRAIN[@]}" ${FIT:+--max-seconds "$S"} "$@"
phase training

# 3. Export the servable draft directory (config.json + model.safetensors).
python export.py "$OUT" --out-dir "$OUT/export"
phase export
# 4. Served tau in the time left, once training has finished: its summary closes the job.
if tail -n 1 "$OUT/log.jsonl" | grep -q '"kind": "final"'; then
    S=$(left $SERVED_END "the served evaluation")
    python -m tools.served "$OUT" --fast --max-new-tokens 160 --max-seconds "$S"
    phase served
fi
python -m tools.plot "$OUT"  # $OUT/training.svg: loss, held-out and served tau
echo "[run.sh] the job: $(((SECONDS - start) / 60)) min $(((SECONDS - start) % 60)) s of ${BUDGET_MIN:-45}"
