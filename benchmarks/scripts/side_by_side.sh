#!/usr/bin/env bash
# This checkout against an earlier commit, side by side in one run on one GPU: the GDN-1.3B plain
# step (benchmarks/e2e.py's step study at budget 0, batches 1 and 64) and the trained `small`
# target's batch-1 tree and chain rows on GSM8K (`specla bench`, plain decoding measured in the
# same process). The two trees run alternately, BASE then HEAD, REPEATS times, so that drift of
# the machine falls on both; read medians over the repeats.
#
#   mkdir .old && git archive COMMIT specla plugins pyproject.toml README.md benchmarks \
#     | tar -x -C .old && rm -rf .old/plugins/*/assets           # here, beside .whl/ (device_env.sh)
#   bash benchmarks/scripts/side_by_side.sh .old COMMIT OUT_DIR [DATA_DIR]   # on the GPU machine
#
# Both trees are installed with FLA and pydantic from .whl/ by device_env.sh (HEAD into /tmp/site,
# BASE into /tmp/site_base). The target and its EAGLE drafter are trained once, with HEAD, by
# benchmarks/small_target.sh (OUT_DIR/small, OUT_DIR/eagle; a finished stage is kept, so a
# cut-off run is finished by running the command again) and both trees decode that checkpoint.
# PHASES (default train,step,rows; also engine: the serving engines' kernel cells, below) picks
# the parts; LIMIT (prompts per row, default 24) and REPEATS (default 2) size them. Writes
# OUT_DIR/{step,rows,engine}-{base,head}-*.json and OUT_DIR/side_by_side.log; each report's
# meta.commit names its tree (BASE through SPECLA_COMMIT).
set -uo pipefail
base=${1:?usage: bash benchmarks/scripts/side_by_side.sh BASE_DIR BASE_COMMIT OUT_DIR [DATA_DIR]}
base_commit=${2:?usage: bash benchmarks/scripts/side_by_side.sh BASE_DIR BASE_COMMIT OUT_DIR [DATA_DIR]}
out=${3:?usage: bash benchmarks/scripts/side_by_side.sh BASE_DIR BASE_COMMIT OUT_DIR [DATA_DIR]}
data=${4:-../shared/data}
phases=,${PHASES:-train,step,rows},
root=$(cd "$(dirname "$0")/../.." && pwd)
base=$(cd "$base" && pwd)
data=$(cd "$data" && pwd)
mkdir -p "$out"
log=$out/side_by_side.log

install() {  # install() SITE TREE: device_env.sh's install of TREE into SITE, once per machine
  [ -f "$1/.installed" ] && return 0
  bash "$root/benchmarks/scripts/device_env.sh" "$1" "$2" && touch "$1/.installed"
}
install /tmp/site "$root" && install /tmp/site_base "$base" || { echo "install failed" >&2; exit 1; }
head_env=(env PYTHONPATH=/tmp/site)
base_env=(env PYTHONPATH=/tmp/site_base SPECLA_COMMIT="$base_commit")
# the CLI moved under specla.apps with the adapter redesign; the engine switches under "engine"
cli() { if [ -f "$1/specla/apps/cli.py" ]; then echo specla.apps.cli; else echo specla.cli; fi; }
head_cli=$(cli "$root"); base_cli=$(cli "$base")
nested() { grep -q "class EngineOptions" "$1/specla/config.py" 2>/dev/null; }

if [[ $phases == *,train,* ]]; then
  "${head_env[@]}" bash "$root/benchmarks/small_target.sh" "$out" "$data" none >> "$out/recipe.log" 2>&1 ||
    { tail -20 "$out/recipe.log"; exit 1; }
  grep "held-out\|keeping" "$out/recipe.log" | tail -3 | tee -a "$log"
fi

for r in $(seq 1 "${REPEATS:-2}"); do
  for side in base head; do
    if [ $side = base ]; then envs=("${base_env[@]}"); tree=$base; mod=$base_cli
    else envs=("${head_env[@]}"); tree=$root; mod=$head_cli; fi
    if [[ $phases == *,step,* ]]; then
      # e2e.py reads its default profile paths relative to the repository root
      (cd "$root" && "${envs[@]}" python "$tree/benchmarks/e2e.py" --out "$out/step-$side-$r" --studies step \
          --batches 1,64 --budgets 0 --allow-dirty > "$out/step-$side-$r.log" 2>&1)
      echo "== step $side $r rc=$?" | tee -a "$log"
      grep -h "^| [0-9]" "$out/step-$side-$r/e2e.md" 2>/dev/null | tee -a "$log"
    fi
    if [[ $phases == *,rows,* ]]; then
      for shape in tree chain; do
        if [ $shape = tree ]; then s='"num_draft_tokens":15,"max_depth":6,"top_k":4'
        else s='"num_draft_tokens":6,"max_depth":6,"top_k":1'; fi
        if nested "$tree"; then config="{$s,\"dtype\":\"bfloat16\",\"engine\":{\"budget_policy\":\"fixed\"}}"
        else config="{$s,\"dtype\":\"bfloat16\",\"budget_policy\":\"fixed\"}"; fi
        name=rows-$shape-$side-$r
        # from the tree's own folder: `python -m` puts the working directory first on sys.path, so
        # from the repository root BASE's run would import this checkout's specla
        (cd "$tree" && timeout "${ROW_TIMEOUT:-120}" "${envs[@]}" python -m "$mod" bench --model "$out/small" \
            --drafter "$out/eagle" --prompts "$data/prompts/gsm8k_test.jsonl" --limit "${LIMIT:-24}" \
            --max-new-tokens 128 --batch-size 1 --device cuda --config "$config" --out "$out/$name.json" \
            --allow-dirty > "$out/$name.log" 2>&1)
        echo "== $shape $side $r rc=$?" | tee -a "$log"
        grep "^all " "$out/$name.log" | tee -a "$log"
      done
    fi
    if [[ $phases == *,engine,* ]]; then
      # benchmarks/engine_kernels.py's GDN cells (ENGINE_ARGS, the script's arguments but
      # --kernels and --out; default Qwen3-Next-80B-A3B at TP 4, the engines' files in .engines/),
      # each tree with its own script; on HEAD's side also with BASE's script, whose contender
      # list is BASE's: a change that follows the script rather than the library is the benchmark's
      scripts=("$tree")
      [ $side = head ] && scripts+=("$base")
      for script in "${scripts[@]}"; do
        name=engine-$side-$([ "$script" = "$tree" ] && echo own || echo base-script)-$r
        # shellcheck disable=SC2086  # ENGINE_ARGS is a list of arguments
        (cd "$tree" && "${envs[@]}" python "$script/benchmarks/engine_kernels.py" --kernels "$root/.engines" \
            ${ENGINE_ARGS:---models qwen3-next-80b-a3b --tp 4 --trees 8,32 --chains 4 --batches 1,8} \
            --allow-dirty --out "$out/$name.json" > "$out/$name.log" 2>&1)
        echo "== $name rc=$?" | tee -a "$log"
        grep -h "| \(tree\|chain\)[0-9]* |" "$out/$name.md" 2>/dev/null | head -12 | cut -c1-160 | tee -a "$log"
      done
    fi
  done
done
