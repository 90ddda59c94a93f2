#!/bin/bash
# sixth session, call D (x2, ~9 min): the e2e study after this session's changes (serial one-token verify in graphs,
# dot-form pending commit, multi-tensor state copies, bound replays). GPU0: step study, oracle; GPU1: baselines.
R=/tmp/res; mkdir -p $R
P=benchmarks/results/2026-11-30/run4/acceptance-gsm8k.json
PROF="--profile $P:gsm8k/eagle-tree --chain-profile $P:gsm8k/eagle-chain"
(export CUDA_VISIBLE_DEVICES=0
 TRITON_INTERPRET=0 timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_graphs.py tests/test_ops_act.py > $R/gpu-tests.log 2>&1; tail -n 3 $R/gpu-tests.log
 timeout 140 python3 benchmarks/e2e.py --out $R/step1 --studies step --batches 1,8 --budgets 0,1,4,15,16,63 > $R/step1.log 2>&1
 timeout 130 python3 benchmarks/e2e.py --out $R/step2 --studies step --batches 32,64 --budgets 0,4,15,63 > $R/step2.log 2>&1
 timeout 160 python3 benchmarks/e2e.py --out $R/oracle --studies oracle --batches 1,64 $PROF > $R/oracle.log 2>&1
 grep -h '"study"' $R/step1.log $R/step2.log | cut -c1-160) &
(export CUDA_VISIBLE_DEVICES=1
 timeout 190 python3 benchmarks/e2e.py --out $R/base1 --studies baselines --batches 1,8 $PROF > $R/base1.log 2>&1
 timeout 340 python3 benchmarks/e2e.py --out $R/base2 --studies baselines --batches 32,64 $PROF > $R/base2.log 2>&1) &
wait
cat $R/base1/e2e.md $R/base2/e2e.md $R/oracle/e2e.md 2>/dev/null
