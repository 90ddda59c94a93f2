#!/usr/bin/env bash
# BENCHMARKS.md section 5 in one command: benchmarks/e2e.py's step, oracle and baselines studies at
# the GDN-1.3B shape, each drafter replaying its own GSM8K acceptance profile of the `small` target
# (attention drafter), then the merged tables and plots. One CUDA GPU, FLA installed; about 15
# minutes on an H200.
#
#   bash benchmarks/scripts/gdn13b_e2e.sh OUT_DIR [PROFILE_JSON]
#
# PROFILE_JSON: an acceptance.py report with gsm8k/eagle-tree and gsm8k/eagle-chain runs (default
# benchmarks/results/2026-11-30/run4/acceptance-gsm8k.json, the profile of every section-5 table
# after the norm fusion). The studies are split by batch as in the recorded runs, each writing
# OUT_DIR/<name>/e2e.{json,md} and <name>.log; OUT_DIR/e2e.md and the plots merge them.
set -euo pipefail
out=${1:?usage: bash benchmarks/scripts/gdn13b_e2e.sh OUT_DIR [PROFILE_JSON]}
root=$(cd "$(dirname "$0")/../.." && pwd)
p=${2:-$root/benchmarks/results/2026-11-30/run4/acceptance-gsm8k.json}
prof=(--profile "$p:gsm8k/eagle-tree" --chain-profile "$p:gsm8k/eagle-chain")
e2e() { local name=$1; shift; python "$root/benchmarks/e2e.py" --out "$out/$name" "$@" 2>&1 | tee "$out/$name.log"; }
mkdir -p "$out"
e2e step1 --studies step --batches 1,8 --budgets 0,1,4,15,16,63
e2e step2 --studies step --batches 32,64 --budgets 0,4,15,63
e2e oracle --studies oracle --batches 1,64 "${prof[@]}"
e2e base1 --studies baselines --batches 1,8 "${prof[@]}"
e2e base2 --studies baselines --batches 32,64 "${prof[@]}"
python "$root/benchmarks/e2e.py" --out "$out" --replot "$out"/{step1,step2,oracle,base1,base2}/e2e.json
