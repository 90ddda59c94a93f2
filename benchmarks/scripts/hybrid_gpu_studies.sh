#!/usr/bin/env bash
# The GPU measurements of issues 17 and 18 that the CPU cannot make, on one GPU:
#   bash benchmarks/scripts/hybrid_gpu_studies.sh OUT [PART ...]
# PARTs (default: all, in this order; a device command of at most 10 minutes takes a few at a time):
# - attention -> OUT/attention-verify.jsonl: one attention layer's tree verify (SDPA with a mask,
#   as the mixer runs it) and its KV commit at four published shapes
#   (benchmarks/scripts/attention_verify.py);
# - granite-4.0-h-tiny, falcon-h1-1.5b, mamba2-1.3b, kimi-linear-48b-32e -> OUT/<model>/hybrid.json:
#   hybrid_study.py cost models (random weights, oracle acceptance) at those published shapes
#   (Kimi Linear with 32 routed experts), batches 1 and 8. Each study writes its rows as it goes,
#   so a run cut short keeps what it measured;
# - flex -> OUT/attention-flex.jsonl: the same verify through compiled FlexAttention, checked
#   in bfloat16 against SDPA; last, because it compiles per shape (minutes at head dim 256).
set -euo pipefail
OUT=${1:?usage: hybrid_gpu_studies.sh OUT [PART ...]}
shift
PARTS=("$@")
[ ${#PARTS[@]} -gt 0 ] || PARTS=(attention granite-4.0-h-tiny falcon-h1-1.5b mamba2-1.3b kimi-linear-48b-32e flex)
mkdir -p "$OUT"
for part in "${PARTS[@]}"; do
  case "$part" in
    attention) python benchmarks/scripts/attention_verify.py --variants sdpa_mask,commit_kv > "$OUT/attention-verify.jsonl" ;;
    flex) python benchmarks/scripts/attention_verify.py --variants flex --check-dtype bfloat16 > "$OUT/attention-flex.jsonl" ;;
    # a large embedding scale keeps the greedy token the input token through Mamba2 and KDA layers
    # (BENCHMARKS.md section 7, Bamba)
    *) python benchmarks/hybrid_study.py --out "$OUT/$part" --models "$part" --batches 1,8 --embed-scale 2000 ;;
  esac
done
