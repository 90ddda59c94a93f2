#!/bin/bash
# sixth session, call B (x2): GPU tests of the new kernel/runner; kernel micro-bench; step profiles of three variants
R=/tmp/res; mkdir -p $R
(export CUDA_VISIBLE_DEVICES=0 TRITON_INTERPRET=0
 timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_gdn_kernels.py tests/test_graphs.py tests/test_gpu.py tests/test_eagle.py tests/test_conformance_gdn.py -x > $R/gpu-tests.log 2>&1
 tail -n 4 $R/gpu-tests.log
 timeout 150 python3 .runs/kbench.py > $R/kbench.log 2>&1; cat $R/kbench.log | grep "|") &
(export CUDA_VISIBLE_DEVICES=1
 for v in default ar-serial no-overlap; do timeout 125 python3 .runs/prof13b.py --variant $v > $R/prof-$v.log 2>&1; grep "===" $R/prof-$v.log; done) &
wait
