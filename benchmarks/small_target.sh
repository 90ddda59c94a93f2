#!/usr/bin/env bash
# The small-target study in one command (BENCHMARKS.md section 4): train the `small` GDN target,
# train its EAGLE drafter, then run benchmarks/acceptance.py. One CUDA GPU, ~6 minutes before the
# acceptance runs; nothing is downloaded. PRESET=small-hybrid trains the Qwen3.5-architecture
# hybrid of the same size instead, and its MTP layer (benchmarks/targets/train_mtp.py, MTP_STEPS,
# default 1500) before the EAGLE drafter; the model goes to OUT_DIR/PRESET.
#
#   bash benchmarks/small_target.sh OUT_DIR [DATA_DIR] [RUNS]
#
# DATA_DIR (default ../shared/data) holds corpus/, prompts/ and tokenizer/. RUNS is a comma-separated
# subset of acceptance.py's runs (default: all; `none`: stop after the training). TIME_PER_RUN (seconds, default 90: with CUDA graphs enough for a whole suite per greedy run at batch 32 on an H200), BATCH_SIZE
# (default 32), STEPS (target steps, default 434: what a 220 s throughput probe chose on an
# H200), TIME_BUDGET (seconds: train the target for as many steps as a throughput probe says fit
# instead of STEPS; the chosen count is in its training.json), MTP_TIME_BUDGET (likewise for the
# MTP layer) and DRAFTER_STEPS (EAGLE drafter steps, default 3000) can be set in the environment;
# ALLOW_DIRTY=1 lets acceptance.py run on a tree with uncommitted changes (--allow-dirty).
# A stage whose output finished is kept (run again to finish a cut-off run; rm -r OUT_DIR to rebuild). Writes OUT_DIR/{small,eagle,acceptance.json,*.log}.
set -euo pipefail
out=${1:?usage: bash benchmarks/small_target.sh OUT_DIR [DATA_DIR] [RUNS]}
data=${2:-../shared/data}
runs=${3:-}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
preset=${PRESET:-small}
dirty=${ALLOW_DIRTY:+--allow-dirty}
# acceptance.py refuses a checkout with uncommitted changes: found before the training, not after it
[ "$runs" = none ] || python "$here/provenance.py" $dirty
# a stage whose output is finished (its training.json is written last) is kept, so a run that
# stopped part-way is finished by running the same command again; a retrained target retrains
# everything after it (rm -r OUT_DIR to rebuild from nothing)
fresh=0
if [ -f "$out/$preset/training.json" ]; then
  echo "keeping the trained target in $out/$preset"
else
  fresh=1
  python "$here/targets/train_target.py" --preset "$preset" --corpus "$data/corpus" --tokenizer "$data/tokenizer" \
      --out "$out/$preset" --steps "${STEPS:-434}" ${TIME_BUDGET:+--time-budget "$TIME_BUDGET"} 2>&1 | tee "$out/train.log"
fi
if [ "$preset" = small-hybrid ]; then
  if [ $fresh = 0 ] && [ -f "$out/$preset/mtp_training.json" ]; then
    echo "keeping the trained MTP layer in $out/$preset"
  else
    python "$here/targets/train_mtp.py" --model "$out/$preset" --corpus "$data/corpus" --steps "${MTP_STEPS:-1500}" \
        ${MTP_TIME_BUDGET:+--time-budget "$MTP_TIME_BUDGET"} 2>&1 | tee "$out/mtp.log"
  fi
fi
if [ $fresh = 0 ] && [ -f "$out/eagle/training.json" ]; then
  echo "keeping the trained EAGLE drafter in $out/eagle"
else
  python -m specla.apps.cli train-drafter --model "$out/$preset" --data "$data"/corpus/*.xz --out "$out/eagle" \
      --steps "${DRAFTER_STEPS:-3000}" --batch-windows 32 --window 128 --max-tokens 400000 --distill-prompts 2048 \
      --ce-weight 1.0 --unroll 3 --device cuda --overwrite 2>&1 | tee "$out/drafter.log"
fi
[ "$runs" = none ] && exit 0
python "$here/acceptance.py" --model "$out/$preset" --drafter "$out/eagle" --prompts "$data/prompts" \
    --out "$out/acceptance.json" --time-per-run "${TIME_PER_RUN:-90}" --batch-size "${BATCH_SIZE:-32}" \
    --max-new-tokens 128 ${runs:+--runs "$runs"} $dirty 2>&1 | tee "$out/acceptance.log"
