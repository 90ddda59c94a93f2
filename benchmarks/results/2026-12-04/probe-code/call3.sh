#!/usr/bin/env bash
start=$(date +%s); el() { echo "[$(( $(date +%s) - start )) s]"; }
source benchmarks/scripts/device_env.sh > /dev/null || exit 1
el
timeout 120 python3 -m pytest -q tests/test_ops_conv.py "tests/test_gdn_kernels.py::test_kernels_at_gdn13b_layer_shape_bf16" > $OUT/pytest-gdn13b.log 2>&1; echo "pytest rc=$? $(tail -1 $OUT/pytest-gdn13b.log)"; el
PROBE_SHAPES=1.3b SKIP_CONV=1 timeout 150 python3 .work/probe2.py > $OUT/probe3.log 2>&1; echo "probe rc=$?"; grep "^|\|q " $OUT/probe3.log; el
timeout $(( 560 - ($(date +%s) - start) )) python3 benchmarks/e2e.py --out $OUT/e2e --studies baselines --batches 1,64 --core-rows > $OUT/e2e.log 2>&1; echo "e2e rc=$?"
grep '"row"' $OUT/e2e.log | python3 -c "
import json, sys
for l in sys.stdin:
    d = json.loads(l); print(d['B'], d['row'], round(d.get('ms_per_step', 0), 4), round(d.get('vs_best_ar', 0), 3), d.get('accepted_per_step'), d.get('exact'))
"; el
