#!/usr/bin/env bash
# The GPU measurements of issues 17 and 18 that the CPU cannot make, in one run on one GPU:
#   bash benchmarks/scripts/hybrid_gpu_studies.sh OUT
# - OUT/attention-verify.jsonl: one attention layer's tree verify (SDPA with a mask, as the mixer
#   runs it, against compiled FlexAttention) and its KV commit at four published shapes
#   (benchmarks/scripts/attention_verify.py);
# - OUT/<model>/hybrid.json: hybrid_study.py cost models (random weights, oracle acceptance) at
#   Granite-4.0-H-Tiny, Falcon-H1-1.5B, transformers' Mamba2-1.3B and Kimi-Linear-48B (32 routed
#   experts) shapes, batches 1 and 8. Each study writes its rows as it goes, so a run cut short
#   keeps what it measured.
set -euo pipefail
OUT=${1:?usage: hybrid_gpu_studies.sh OUT}
mkdir -p "$OUT"
python benchmarks/scripts/attention_verify.py > "$OUT/attention-verify.jsonl"
for model in granite-4.0-h-tiny falcon-h1-1.5b mamba2-1.3b kimi-linear-48b-32e; do
  # a large embedding scale keeps the greedy token the input token through Mamba2 and KDA layers
  # (BENCHMARKS.md section 7, Bamba)
  python benchmarks/hybrid_study.py --out "$OUT/$model" --models "$model" --batches 1,8 --embed-scale 2000
done
