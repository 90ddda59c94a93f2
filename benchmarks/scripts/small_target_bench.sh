#!/usr/bin/env bash
# Speed rows of the trained `small` target in one command (BENCHMARKS.md section 4): rebuild the
# target and its EAGLE drafter with benchmarks/small_target.sh (its recipe without the acceptance
# runs, about 6 minutes on an H200), then one `specla bench` per row, plain decoding (specla's
# graph step) side by side in each. Run from the repository root with the environment where
# specla is installed (`python` is called as found on PATH: activate the venv first).
#
#   bash benchmarks/scripts/small_target_bench.sh OUT_DIR [DATA_DIR [ROW ...]]
#
# DATA_DIR (default ../shared/data) holds corpus/, prompts/ and tokenizer/; to give rows, give it
# too. A ROW is SUITE:SHAPE:BATCH[:POLICY[:T]]: SUITE gsm8k (gsm8k_test.jsonl) or mixed
# (specbench_like.jsonl), SHAPE tree (N 15, depth 6, top-k 4) or chain (N 6), POLICY fixed
# (default), adaptive or auto (SpecConfig's default), T the sampling temperature (default 0, greedy; a sampled row has seed 0
# and its exact-match rate is not expected to be 1). Default rows: gsm8k:tree:1 gsm8k:chain:1 mixed:tree:1 mixed:chain:1.
# Rows are checked before anything runs. Environment: PRESET (small, default, or small-hybrid: the
# Qwen3.5-architecture hybrid with its MTP layer; its model is OUT_DIR/PRESET), DRAFTER (eagle,
# default: OUT_DIR/eagle; mtp: the checkpoint's MTP layer; ngram), CONFIG (extra SpecConfig fields appended to
# every row's JSON, e.g. CONFIG='"max_depth":4'; default none), ENGINE (extra EngineOptions fields appended to
# every row's "engine", e.g. ENGINE='"prefill":"chunked"'; default none), LIMIT (prompts per row, default 64),
# ROW_TIMEOUT (seconds per row, default 100), MAX_NEW_TOKENS (default 128), STEPS, TIME_BUDGET,
# MTP_TIME_BUDGET and DRAFTER_STEPS (passed to small_target.sh: its training lengths), DEVICE (default cuda; cpu runs the rows, slowly, when OUT_DIR
# already holds PRESET/ and what DRAFTER reads, e.g. copies of plugins/fla/assets/tiny and tiny-eagle: a check
# of the script), ALLOW_DIRTY=1 (the rows run on a tree with uncommitted changes: --allow-dirty). Writes OUT_DIR/bench-ROW.json (the `specla bench` report, ':' as '-') and
# OUT_DIR/bench.log; the models stay in OUT_DIR/PRESET and OUT_DIR/eagle (one OUT_DIR per preset), small_target.sh's logs
# beside them.
set -uo pipefail
if [ $# -lt 1 ]; then
  echo "usage: bash benchmarks/scripts/small_target_bench.sh OUT_DIR [DATA_DIR [ROW ...]]" >&2
  exit 2
fi
out=$1
data=${2:-../shared/data}
shift $(( $# >= 2 ? 2 : $# ))
rows=("$@")
[ ${#rows[@]} -eq 0 ] && rows=(gsm8k:tree:1 gsm8k:chain:1 mixed:tree:1 mixed:chain:1)
for row in "${rows[@]}"; do  # all rows checked before the training
  if ! [[ $row =~ ^(gsm8k|mixed):(tree|chain):[1-9][0-9]*(:(fixed|adaptive|auto)(:[0-9]+(\.[0-9]+)?)?)?$ ]]; then
    echo "bad row '$row': expected SUITE:SHAPE:BATCH[:POLICY[:T]], SUITE gsm8k|mixed, SHAPE tree|chain," \
         "BATCH a positive integer, POLICY fixed|adaptive|auto, T a temperature such as 0.7" >&2
    exit 2
  fi
done
here=$(cd "$(dirname "$0")/.." && pwd)
preset=${PRESET:-small}
case $preset in
  small|small-hybrid) ;; *) echo "bad PRESET '$preset': expected small or small-hybrid" >&2; exit 2 ;;
esac
case ${DRAFTER:-eagle} in
  eagle) drafter=$out/eagle ;; mtp|ngram) drafter=$DRAFTER ;;
  *) echo "bad DRAFTER '$DRAFTER': expected eagle, mtp or ngram" >&2; exit 2 ;;
esac
if [ "$drafter" = mtp ] && [ "$preset" != small-hybrid ]; then
  echo "DRAFTER=mtp needs PRESET=small-hybrid (the small GDN target has no MTP layer)" >&2; exit 2
fi
mkdir -p "$out"
dirty=${ALLOW_DIRTY:+--allow-dirty}
# each row's report refuses a checkout with uncommitted changes: found before the training, not after it
python "$here/provenance.py" $dirty || exit 2
# the recipe, without its acceptance runs: it keeps the stages OUT_DIR already holds finished and
# trains the rest (every DRAFTER's rows share one OUT_DIR)
PRESET=$preset bash "$here/small_target.sh" "$out" "$data" none >> "$out/recipe.log" 2>&1 ||
  { tail -20 "$out/recipe.log"; exit 1; }
grep "held-out\|keeping" "$out/recipe.log" | tail -3
declare -A suite=([gsm8k]=gsm8k_test.jsonl [mixed]=specbench_like.jsonl)
declare -A shape=([tree]='"num_draft_tokens":15,"max_depth":6,"top_k":4' [chain]='"num_draft_tokens":6,"max_depth":6,"top_k":1')
failed=0
for row in "${rows[@]}"; do
  IFS=: read -r s t b p temp <<< "$row"
  config="{${shape[$t]},\"dtype\":\"bfloat16\",\"temperature\":${temp:-0},\"seed\":0${CONFIG:+,$CONFIG},"
  config+="\"engine\":{\"budget_policy\":\"${p:-fixed}\"${ENGINE:+,$ENGINE}}}"
  name=${row//:/-}${DRAFTER:+-$DRAFTER}${CONFIG:+-$(tr -dc 'a-z0-9' <<< "${CONFIG//:/-}")}
  name+=${ENGINE:+-$(tr -dc 'a-z0-9' <<< "${ENGINE//:/-}")}
  timeout "${ROW_TIMEOUT:-100}" python -m specla.apps.cli bench --model "$out/$preset" --drafter "$drafter" \
      --prompts "$data/prompts/${suite[$s]}" --limit "${LIMIT:-64}" --max-new-tokens "${MAX_NEW_TOKENS:-128}" \
      --batch-size "$b" --device "${DEVICE:-cuda}" --config "$config" --out "$out/bench-$name.json" $dirty \
      --execute-code \
      > "$out/bench-$name.log" 2>&1
  rc=$?
  echo "== $row rc=$rc $config"
  [ $rc -eq 0 ] || failed=$((failed + 1))
  grep "^all " "$out/bench-$name.log"
  cat "$out/bench-$name.log" >> "$out/bench.log" && rm "$out/bench-$name.log"
done
[ "$failed" -eq 0 ] || { echo "$failed row(s) failed: see $out/bench.log" >&2; exit 1; }
