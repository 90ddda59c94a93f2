#!/usr/bin/env bash
# Issue 16's speed rows on the trained `small` target in one command (BENCHMARKS.md section 4):
# rebuild the target and its EAGLE drafter by the recipe of benchmarks/small_target.sh (about 6
# minutes on an H200), then `specla bench` rows, AR (specla's graph step) side by side in each.
#
#   bash benchmarks/scripts/small_target_bench.sh OUT_DIR [DATA_DIR] [ROW ...]
#
# A ROW is SUITE:SHAPE:BATCH[:POLICY], SUITE gsm8k (gsm8k_test.jsonl) or mixed
# (specbench_like.jsonl), SHAPE tree (N 15, depth 6, top-k 4) or chain (N 6), POLICY fixed
# (default) or adaptive. Default rows: gsm8k:tree:1 gsm8k:chain:1 mixed:tree:1 mixed:chain:1.
# LIMIT (prompts per row, default 64), ROW_TIMEOUT (seconds per row, default 100), MAX_NEW_TOKENS
# (default 128) and DEVICE (default cuda; with OUT_DIR/small and OUT_DIR/eagle present, cpu
# checks the script) can be set in the environment. Writes OUT_DIR/bench-ROW.json (the `specla bench`
# report, ':' as '-') and OUT_DIR/bench.log; the models stay in OUT_DIR/small and OUT_DIR/eagle.
set -uo pipefail
out=${1:?usage: bash benchmarks/scripts/small_target_bench.sh OUT_DIR [DATA_DIR] [ROW ...]}
data=${2:-../shared/data}
shift $(( $# >= 2 ? 2 : $# ))
rows=("$@")
[ ${#rows[@]} -eq 0 ] && rows=(gsm8k:tree:1 gsm8k:chain:1 mixed:tree:1 mixed:chain:1)
here=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
if [ ! -d "$out/small" ] || [ ! -d "$out/eagle" ]; then
  python "$here/targets/train_target.py" --preset small --corpus "$data/corpus" --tokenizer "$data/tokenizer" \
      --out "$out/small" --steps "${STEPS:-434}" > "$out/train.log" 2>&1 || { tail -20 "$out/train.log"; exit 1; }
  grep "held-out" "$out/train.log"
  python -m specla.cli train-drafter --model "$out/small" --data "$data"/corpus/*.xz --out "$out/eagle" \
      --steps 3000 --batch-windows 32 --window 128 --max-tokens 400000 --distill-prompts 2048 --ce-weight 1.0 \
      --unroll 3 --device cuda --overwrite > "$out/drafter.log" 2>&1 || { tail -20 "$out/drafter.log"; exit 1; }
fi
declare -A suite=([gsm8k]=gsm8k_test.jsonl [mixed]=specbench_like.jsonl)
declare -A shape=([tree]='"num_draft_tokens":15,"max_depth":6,"top_k":4' [chain]='"num_draft_tokens":6,"max_depth":6,"top_k":1')
for row in "${rows[@]}"; do
  IFS=: read -r s t b p <<< "$row"
  config="{${shape[$t]},\"dtype\":\"bfloat16\",\"budget_policy\":\"${p:-fixed}\"}"
  name=${row//:/-}
  timeout "${ROW_TIMEOUT:-100}" python -m specla.cli bench --model "$out/small" --drafter "$out/eagle" \
      --prompts "$data/prompts/${suite[$s]}" --limit "${LIMIT:-64}" --max-new-tokens "${MAX_NEW_TOKENS:-128}" \
      --batch-size "$b" --device "${DEVICE:-cuda}" --config "$config" --out "$out/bench-$name.json" > "$out/bench-$name.log" 2>&1
  echo "== $row rc=$? $config"
  grep "^all " "$out/bench-$name.log"
  cat "$out/bench-$name.log" >> "$out/bench.log" && rm "$out/bench-$name.log"
done
