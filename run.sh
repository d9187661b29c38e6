#!/usr/bin/env bash
# The main job: a DFlash2 draft for the embedded SmolLM2-135M-Instruct, trained on a 2-core CPU within
# BUDGET_MIN minutes (default 45), ending with its held-out accepted lengths: teacher-forced at random
# anchors, and served (16 held-out prompts decoded by the real loop, served.py), side by side.
#
#   bash run.sh                  # DFlash2 on the maths demo: school word problems, held out on GSM8K test
#   bash run.sh --dflash         # the plain DFlash baseline on the same data and budget
#   DOMAIN=general bash run.sh   # the general mix (chat, code, maths), held out on MT-Bench/HumanEval/GSM8K
#   bash run.sh --max-steps 4000 # any train.py flag; N_TRAIN=4800 bash run.sh for more data
#   BUDGET_MIN=90 bash run.sh    # a longer budget: plan.py sizes the job to it (N_TRAIN, --epochs win)
#
# Step 0 measures this machine with small probes (under a minute) and sizes the job to the budget
# (tools/plan.py): answers and epochs from a measured learning curve, and the fixed costs (held-out set,
# served evaluation, evaluations during training) at the share of the budget they take on a fast CPU; a
# budget too small for a useful job ends here, in one line naming the budget that would hold one. On a
# 2-core CPU: about 1,000-1,800 answers where bf16 is native, 500 without it, 180-500 on an AVX2-only
# Zen 1 (docs/cpu.md). N_EVAL, SERVED_SAMPLES, SERVED_TOKENS given are kept. Every precision and
# GEMM layout is `auto`: speed/machine.py picks them per CPU and each script prints what it chose.
# Before training the plan runs again (seconds): the steps that fit what prepare left of the budget,
# and their seconds, to which train.py --max-seconds fits its steps as it runs (not where --epochs or
# --max-steps are given).
# Step 1 resumes and skips what is done, so a second run only trains; --resume continues a stopped
# training (--steps-this-run N stops one after N steps). OUT=DIR trains into another folder.
set -euo pipefail
cd "$(dirname "$0")"

# bash run.sh --toy: a TOY, a first run in minutes. The real prepare -> train -> export -> generate
# code, on a target small enough to make here first: tools/toy_target.py trains a tiny Llama-style
# model (4 layers, width 64, a word-level vocabulary) for a minute or two on the project's own toy
# word problems with worked answers (prompts/toy_problems.py). It ends with generate.py --compare
# --show on a held-out problem: the draft commits several tokens a cycle and beats plain decoding;
# then its pictures, listed in its last lines: that decoding ($OUT/decode.svg) and the training.
# Why a toy shows what DFlash is for: a tiny target's step is bound by per-forward overhead, not by
# arithmetic, so verifying 8 tokens costs about one step and every drafted token the target accepts
# is nearly free. That is the regime DFlash is built for; on a GPU the same holds for a large target,
# because its step is bound by reading the weights. (The main job's 135M target on a CPU is not
# there: its verify costs several steps, docs/cpu.md.) OUT=DIR puts it elsewhere (default out/toy).
# bash run.sh --toy --dflash: the plain DFlash baseline, on the same target and data, into
# $OUT/draft-dflash; once both drafts are trained, $OUT/dflash-vs-dflash2.svg draws them side by side.
if [ "${1:-}" = --toy ]; then
    start=$SECONDS t0=$SECONDS
    OUT=${OUT:-out/toy} CFG=configs/toy-dflash2.json
    TARGET=$OUT/target DRAFT=$OUT/draft DECODE=$OUT/decode.svg NAME=DFlash2 VARIANT=()
    if [ "${2:-}" = --dflash ]; then
        DRAFT=$OUT/draft-dflash DECODE=$OUT/decode-dflash.svg NAME=DFlash VARIANT=(--dflash)
    fi
    [ -d "$TARGET" ] || python tools/toy_target.py "$TARGET"  # made once, then reused
    echo "[run.sh --toy] toy target: $((SECONDS - t0)) s"; t0=$SECONDS
    # the toy target answers its own training problems (on-policy data) and 32 held-out ones
    PREP=(--target "$TARGET" --target-dtype fp32 --target-gemm stock --regenerate --max-new-tokens 80
        --features --draft-config "$CFG" --batch-size 64 --feature-batch-size 16 --save-target-hidden)
    python prepare.py --prompts toy --num-samples 600 "${PREP[@]}" --out-dir "$OUT/data/train"
    python prepare.py --prompts toy-eval --num-samples 32 "${PREP[@]}" --out-dir "$OUT/data/eval"
    echo "[run.sh --toy] prepare: $((SECONDS - t0)) s"; t0=$SECONDS
    python train.py --draft-config "$CFG" --target "$TARGET" --data "$OUT/data/train" \
        --eval-data "$OUT/data/eval" --eval-samples 32 --out-dir "$DRAFT" --num-anchors 32 \
        --batch-size 4 --lr 3e-3 --epochs 8 --dtype fp32 --eval-interval 100 --quiet "${VARIANT[@]}"
    python tools/served.py "$DRAFT" --samples 32
    python export.py "$DRAFT" --out-dir "$DRAFT/export"
    echo "[run.sh --toy] train, served, export: $((SECONDS - t0)) s"
    # a held-out problem (neither the target nor the draft trained on it), decoded both ways
    PROMPT=$(python -c "from prompts.toy_problems import toy_split; print(toy_split()[1][-3][0])")
    python generate.py --target "$TARGET" --draft "$DRAFT/export" --prompt "$PROMPT" \
        --compare --show --show-svg "$DECODE"
    python tools/plot.py "$DRAFT" --labels "$NAME"  # the training, drawn: $DRAFT/training.svg
    PICTURES="$DECODE $DRAFT/training.svg"
    if [ -f "$OUT/draft/log.jsonl" ] && [ -f "$OUT/draft-dflash/log.jsonl" ]; then
        python tools/plot.py "$OUT/draft-dflash" "$OUT/draft" --labels DFlash DFlash2 \
            --title "the toy: DFlash against DFlash2" --out "$OUT/dflash-vs-dflash2.svg"
        PICTURES="$PICTURES $OUT/dflash-vs-dflash2.svg"
    fi
    echo "[run.sh --toy] pictures: $PICTURES"
    echo "[run.sh --toy] the toy job: $(((SECONDS - start) / 60)) min $(((SECONDS - start) % 60)) s"
    exit 0
fi

CFG=configs/smollm2-135m-dflash2.json
DOMAIN=${DOMAIN:-math}
BUDGET_MIN=${BUDGET_MIN:-45}  # the whole job, in minutes
case $DOMAIN in
    math) TRAIN_SET=math; EVAL_SET=math-eval ;;      # GSM8K test questions 1..48, never trained on
    general) TRAIN_SET=default; EVAL_SET=eval ;;     # MT-Bench, HumanEval, GSM8K interleaved
    *) echo "error: DOMAIN must be math or general, got $DOMAIN" >&2; exit 2 ;;
esac
DATA=${DATA:-data/smollm2-$DOMAIN}
NAME=dflash2
PLAN=(--budget-min "$BUDGET_MIN" --data "$DATA/train" --eval-data "$DATA/eval" --draft-config "$CFG" --domain "$DOMAIN")
[ -n "${N_TRAIN:-}" ] && PLAN+=(--num-samples "$N_TRAIN")
[ -n "${N_EVAL:-}" ] && PLAN+=(--n-eval "$N_EVAL")                       # held-out prompts
[ -n "${SERVED_SAMPLES:-}" ] && PLAN+=(--served-samples "$SERVED_SAMPLES") # served evaluation
[ -n "${SERVED_TOKENS:-}" ] && PLAN+=(--served-tokens "$SERVED_TOKENS")
prev= STEPS_GIVEN=
for a in "$@"; do
    [ "$a" = --dflash ] && { NAME=dflash; PLAN+=(--dflash); }
    [ "$a" = --max-steps ] && STEPS_GIVEN=1
    [ "$prev" = --epochs ] && PLAN+=(--epochs "$a")
    [ "$a" = --out-dir ] && { echo "error: run.sh: name the output folder with OUT=DIR bash run.sh, not --out-dir" >&2; exit 2; }
    prev=$a
done
OUT=${OUT:-out/smollm2-$DOMAIN-$NAME}

start=$SECONDS t0=$SECONDS
# 0. The plan: how many training prompts (answered by the target itself: on-policy data) and epochs fit
#    the budget, and the sizes of its fixed costs; it prints KEY=value lines, read here.
plan=$(python tools/plan.py "${PLAN[@]}")
planned() { sed -n "s/^$1=//p" <<< "$plan"; }
N_TRAIN=$(planned N_TRAIN) EPOCHS=$(planned EPOCHS) N_EVAL=$(planned N_EVAL) EVAL_INTERVAL=$(planned EVAL_INTERVAL)
SERVED_SAMPLES=$(planned SERVED_SAMPLES) SERVED_TOKENS=$(planned SERVED_TOKENS) EXPECTED_TAU=$(planned EXPECTED_TAU)
PLANNED_MIN=$(planned PLANNED_MIN) SERVED_TOKEN_S=$(planned SERVED_TOKEN_S)
echo "[run.sh] plan: $((SECONDS - t0)) s, $N_TRAIN answers x $EPOCHS epochs, expected held-out tau ${EXPECTED_TAU:-unknown}"; t0=$SECONDS
# 1. The target answers the prompts (greedy; in bf16 with oneDNN's packed weights where bf16 is native, else fp32)
#    and its features are captured at target_layer_ids, with its final hidden state for the kl loss.
PREP="--regenerate --max-new-tokens 160 --features --draft-config $CFG --batch-size 64"
python prepare.py --prompts $TRAIN_SET --num-samples "$N_TRAIN" $PREP --save-target-hidden --out-dir "$DATA/train"
python prepare.py --prompts $EVAL_SET --num-samples "$N_EVAL" $PREP --save-target-hidden --out-dir "$DATA/eval"
echo "[run.sh] prepare: $((SECONDS - t0)) s"; t0=$SECONDS
# 2. Train (the recipe study in README.md chose these flags), in bf16 autocast where bf16 is native,
#    for the time that is left of the budget: the plan again, its training step measured again (a
#    shared VM's speed drifts) and prepare's time known, prices the steps (MAX_STEPS) and their
#    seconds (TRAIN_S); train.py --max-seconds then fits the steps to those seconds at its own step
#    time, which runs 0.7-1.3x the probe's by CPU kind. --resume keeps the first run's schedule.
TRAIN_S=
if [[ " $* " == *" --resume "* ]] && [ -f "$OUT/max_steps" ]; then
    MAX_STEPS=$(cat "$OUT/max_steps")
else
    replan=$(python tools/plan.py "${PLAN[@]}" --num-samples "$N_TRAIN" --n-eval "$N_EVAL" \
        --served-samples "$SERVED_SAMPLES" --served-tokens "$SERVED_TOKENS" --served-token-s "$SERVED_TOKEN_S" \
        --elapsed-s $((SECONDS - start)))
    MAX_STEPS=$(sed -n 's/^MAX_STEPS=//p' <<< "$replan") EXPECTED_TAU=$(sed -n 's/^EXPECTED_TAU=//p' <<< "$replan")
    [ -z "$STEPS_GIVEN" ] && TRAIN_S=$(sed -n 's/^TRAIN_S=//p' <<< "$replan")
    mkdir -p "$OUT" && echo "$MAX_STEPS" > "$OUT/max_steps"
fi
python train.py --draft-config "$CFG" --data "$DATA/train" --eval-data "$DATA/eval" --eval-samples "$N_EVAL" \
    --out-dir "$OUT" --num-anchors 32 --lr 1e-3 --epochs "$EPOCHS" --max-steps "$MAX_STEPS" \
    --eval-interval "$EVAL_INTERVAL" --save-interval 300 ${TRAIN_S:+--max-seconds "$TRAIN_S"} "$@"
echo "[run.sh] train: $((SECONDS - t0)) s"; t0=$SECONDS
# 3. Served tau: held-out prompts decoded by the real loop (with speed/tune.py's fast path), once the
#    training has finished: its final record then closes the log (--steps-this-run stops it before).
#    The plan sizes it (SERVED_SAMPLES=0: off).
finished=$(tail -n 1 "$OUT/log.jsonl" | grep -c '"kind": "final"' || true)
if [ "${SERVED_SAMPLES:-16}" != 0 ] && [ "$finished" = 1 ]; then
    python tools/served.py "$OUT" --fast --samples "${SERVED_SAMPLES:-16}" ${SERVED_TOKENS:+--max-new-tokens "$SERVED_TOKENS"}
    echo "[run.sh] served: $((SECONDS - t0)) s"
fi
# 4. Export the servable draft directory (config.json + model.safetensors).
python export.py "$OUT" --out-dir "$OUT/export"
python tools/plot.py "$OUT"  # the run, drawn: $OUT/training.svg (loss, held-out and served tau)
echo "[run.sh] the job: $(((SECONDS - start) / 60)) min $(((SECONDS - start) % 60)) s (planned ${PLANNED_MIN:-?} min, budget $BUDGET_MIN min)"
# 5. The plan's expected tau beside the measured ones: log.jsonl's last final and served records
#    (expected at the steps trained, where --max-seconds fitted them).
[ "$finished" = 1 ] || exit 0
python - "$OUT/log.jsonl" "${EXPECTED_TAU:-unknown}" "$NAME" "$N_TRAIN" "$MAX_STEPS" <<'EOF'
import json, sys
log, expected, name, answers, priced = sys.argv[1:]
records = [json.loads(line) for line in open(log)]
final = [r for r in records if r["kind"] == "final"][-1]
said = f"{expected} (the plan)"
if expected != "unknown" and final["step"] != int(priced):  # --max-seconds fitted the steps
    sys.path.insert(0, "tools")
    from plan import expected_tau
    tau = expected_tau(int(answers), final["step"] / int(answers), name == "dflash")
    said = f"{tau:.2f} (the plan's curve at the {final['step']} steps trained; {expected} at {priced})"
served = [r for r in records if r["kind"] == "served" and r["step"] == final["step"]]
mode = "unary" if name == "dflash" else "selector"
tf = f"measured {final[f'accept_{mode}']:.3f} teacher-forced"
path = f"{served[-1]['served_path_tau']:.3f}" if served else "not run"
print(f"[run.sh] held-out tau: expected {said}, {tf}; served {path} (the path)")
EOF
