#!/bin/bash
# sixth session, call E (x2, short): GLA/Mamba2 recorded one-token steps on CUDA; act kernels; launch sweep for the next session
R=/tmp/res; mkdir -p $R
(export CUDA_VISIBLE_DEVICES=0 TRITON_INTERPRET=0
 timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_graphs.py tests/test_ops_act.py -k "cuda or act or kernel" > $R/gpu-tests.log 2>&1; tail -n 3 $R/gpu-tests.log) &
(export CUDA_VISIBLE_DEVICES=1
 timeout 200 python3 .runs/sweep.py > $R/sweep.log 2>&1; cat $R/sweep.log) &
wait
