#!/usr/bin/env bash
start=$(date +%s); el() { echo "[$(( $(date +%s) - start )) s]"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
source benchmarks/scripts/device_env.sh > /dev/null || exit 1
el
timeout 100 python3 -m pytest -q -x tests/test_ops_conv.py > $OUT/pytest-conv.log 2>&1; echo "pytest conv rc=$? $(tail -1 $OUT/pytest-conv.log)"; el
timeout 240 python3 .work/probe_tv.py 64 > $OUT/probe.log 2>&1; echo "probe rc=$?"; grep -v Warn $OUT/probe.log | tail -45; el
timeout $(( 560 - ($(date +%s) - start) )) python3 benchmarks/scripts/step_anatomy.py --batches 1 --rows ar,eagle-tree --kernel-names > $OUT/anatomy-small.jsonl 2> $OUT/anatomy.err; echo "anatomy rc=$?"; el
python3 - <<'PY'
import json, os
for l in open(os.environ["OUT"] + "/anatomy-small.jsonl"):
    d = json.loads(l)
    if "parts" in d: print(d["row"], {k: (v["ms"], v["kernels"]) for k, v in d["parts"].items()})
    elif "call" in d: print(d["row"], d["call"]["step_ms_median"])
    else: print(d)
PY
