#!/usr/bin/env bash
start=$(date +%s); el() { echo "[$(( $(date +%s) - start )) s]"; }
source benchmarks/scripts/device_env.sh > /dev/null || exit 1
el
timeout 200 python3 .work/probe2.py > $OUT/probe2.log 2>&1; echo "probe2 rc=$?"; grep -v Warn $OUT/probe2.log | grep "^|\|q \|Error\|error" | tail -40; el
timeout 120 python3 -m pytest -q -x tests/test_ops_conv.py tests/test_gdn_kernels.py > $OUT/pytest.log 2>&1; echo "pytest rc=$? $(tail -1 $OUT/pytest.log)"; el
summ() { python3 - "$1" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    d = json.loads(l)
    if "parts" in d: print(d["row"], {k: (v["ms"], v["kernels"]) for k, v in d["parts"].items()})
    elif "call" in d: print(d["row"], "call step median", d["call"]["step_ms_median"], "wall", d["call"]["wall_ms"])
    else: print(d)
PY
}
timeout 200 python3 benchmarks/scripts/step_anatomy.py --batches 1 --rows ar,eagle-tree --kernel-names > $OUT/anatomy-small.jsonl 2> $OUT/anatomy.err; echo "anatomy rc=$?"; summ $OUT/anatomy-small.jsonl; el
timeout $(( 570 - ($(date +%s) - start) )) python3 .work/anat_fused.py --batches 1 --rows eagle-tree > $OUT/anatomy-small-fused.jsonl 2> $OUT/anatomy-fused.err; echo "anatomy fused rc=$?"; summ $OUT/anatomy-small-fused.jsonl; el
