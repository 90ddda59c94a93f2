#!/bin/bash
# session 4, call D (x1): fused-norm path checked on the GPU, then the e2e step study at batch 1 and 8
R=/tmp/res; mkdir -p $R
export TRITON_INTERPRET=0
timeout 75 python3 -m pytest -q -x tests/test_gpu.py -k "default" tests/test_graphs.py -k "default or tree-eagle" -p no:cacheprovider > $R/gpu-tests-fused.log 2>&1
timeout 110 python3 benchmarks/e2e.py --out $R/e2e-step-fused --studies step --batches 1,8 --budgets 0,16,63 > $R/e2e-step-fused.log 2>&1
