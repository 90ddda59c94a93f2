#!/bin/bash
# sixth session, call A (x2): GPU tests of the new act kernels first; profile; baselines with FLA-SD
R=/tmp/res; mkdir -p $R
(export CUDA_VISIBLE_DEVICES=0 TRITON_INTERPRET=0
 timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_ops_act.py tests/test_ops_norm.py tests/test_ops_conv.py tests/test_gpu.py tests/test_graphs.py tests/test_eagle.py -x > $R/gpu-tests.log 2>&1
 tail -n 4 $R/gpu-tests.log
 timeout 150 python3 .runs/prof13b.py > $R/prof.log 2>&1; grep "===" $R/prof.log
 P=benchmarks/results/2026-11-30/run4/acceptance-gsm8k.json
 timeout 170 python3 benchmarks/e2e.py --out $R/base1 --studies baselines --batches 1,8 --profile $P:gsm8k/eagle-tree --chain-profile $P:gsm8k/eagle-chain > $R/base1.log 2>&1; tail -n 30 $R/base1.log) &
(export CUDA_VISIBLE_DEVICES=1; P=benchmarks/results/2026-11-30/run4/acceptance-gsm8k.json
 timeout 520 python3 benchmarks/e2e.py --out $R/base2 --studies baselines --batches 32,64 --profile $P:gsm8k/eagle-tree --chain-profile $P:gsm8k/eagle-chain > $R/base2.log 2>&1) &
wait
