#!/bin/bash
# fifth session, call A (single H200, ~5 min): graph tests on the GPU (sync count, tree-ngram, GLA/Mamba2 recorded)
R=/tmp/res; mkdir -p $R
export TRITON_INTERPRET=0
timeout 420 python3 -m pytest -v -p no:cacheprovider tests/test_graphs.py tests/test_conformance_gdn.py \
  tests/test_conformance_gla.py tests/test_conformance_mamba2.py -k "graph" > $R/gpu-graph-tests.log 2>&1
tail -5 $R/gpu-graph-tests.log
