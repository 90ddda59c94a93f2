#!/bin/bash
# sixth session, call C (x2): GPU tests (serial T=1 in graphs, dot-form pending commit, multi-tensor copies); kernel bench; profile
R=/tmp/res; mkdir -p $R
(export CUDA_VISIBLE_DEVICES=0 TRITON_INTERPRET=0
 timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_gdn_kernels.py tests/test_graphs.py tests/test_gpu.py tests/test_ops_act.py > $R/gpu-tests.log 2>&1
 tail -n 6 $R/gpu-tests.log
 timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_conformance_gdn.py tests/test_conformance_gla.py tests/test_conformance_mamba2.py -k "graph or eagle" > $R/gpu-conf.log 2>&1
 tail -n 6 $R/gpu-conf.log) &
(export CUDA_VISIBLE_DEVICES=1
 timeout 100 python3 .runs/kbench.py > $R/kbench.log 2>&1; grep "|" $R/kbench.log
 timeout 150 python3 .runs/prof13b.py --variant default > $R/prof-default.log 2>&1; grep "===" $R/prof-default.log) &
wait
