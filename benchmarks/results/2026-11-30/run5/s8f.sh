#!/bin/bash
# sixth session, call F (x2, short): after the swept launch settings (tree 4 warps, decode BV16): step study and baselines at batch 1 and 64
R=/tmp/res; mkdir -p $R
P=benchmarks/results/2026-11-30/run4/acceptance-gsm8k.json
PROF="--profile $P:gsm8k/eagle-tree --chain-profile $P:gsm8k/eagle-chain"
(export CUDA_VISIBLE_DEVICES=0
 timeout 80 python3 benchmarks/e2e.py --out $R/step --studies step --batches 1,64 --budgets 0,15 > $R/step.log 2>&1
 timeout 100 python3 benchmarks/e2e.py --out $R/base1 --studies baselines --batches 1 $PROF > $R/base1.log 2>&1
 grep -h '"study"' $R/step.log $R/base1.log | cut -c1-170) &
(export CUDA_VISIBLE_DEVICES=1
 timeout 185 python3 benchmarks/e2e.py --out $R/base64 --studies baselines --batches 64 $PROF > $R/base64.log 2>&1
 grep -h '"study"' $R/base64.log | cut -c1-170) &
wait
