#!/usr/bin/env bash
# The test suite with compiled kernels on the lent GPU machine, whose commands end after 10
# minutes (the whole suite takes longer there). From the repository root, after
# `source benchmarks/scripts/device_env.sh`:
#   bash benchmarks/scripts/gpu_pytest.sh OUT PART [PART ...]
# runs `pytest -n WORKERS` on each PART (a test folder or file, or several in one quoted word
# separated by spaces) in turn, each under its own limit
# of PART_LIMIT seconds (default 280), and writes, under OUT: `pytest-<part>.log`,
# `junit-<part>.xml` (where the part finished), `failures.txt` and `durations.txt` (seconds, phase
# and test), appended as each test reports, and `running-<part>.txt`, the tests started and not
# finished: a part cut by its limit still names the tests that failed or hung before the cut.
# SPECLA_ENGINE_CACHE should name the carried `.engines` folder, so the engine oracle tests run.
set -u
out=$1; shift
mkdir -p "$out"
: > "$out/failures.txt"; : > "$out/durations.txt"  # this run's only
plugin=$(mktemp -d)
cat > "$plugin/specla_failure_log.py" <<'EOF'
import os


CONTROLLER = "PYTEST_XDIST_WORKER" not in os.environ  # the controller holds a copy of each worker's report
running = set()


def pytest_runtest_logstart(nodeid, location):
    if CONTROLLER:
        running.add(nodeid)
        _write_running()


def pytest_runtest_logreport(report):
    if not CONTROLLER:
        return
    if report.failed:
        with open(os.environ["SPECLA_FAILURE_LOG"], "a") as f:
            f.write(f"==== {report.nodeid} ({report.when})\n{str(report.longrepr)[-4000:]}\n")
    if report.when == "teardown":
        running.discard(report.nodeid)
        _write_running()
    with open(os.environ["SPECLA_DURATION_LOG"], "a") as f:
        f.write(f"{report.duration:9.2f} {report.when} {report.nodeid}\n")


def _write_running():  # the tests started and not yet finished, so a run cut by its limit names them
    with open(os.environ["SPECLA_RUNNING_LOG"], "w") as f:
        f.write("".join(f"{n}\n" for n in sorted(running)))
EOF
export SPECLA_FAILURE_LOG=$out/failures.txt SPECLA_DURATION_LOG=$out/durations.txt PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$plugin
status=0
for part in "$@"; do
    name=$(echo "$part" | cut -d' ' -f1 | tr '/.' '--')$([ "$part" = "${part%% *}" ] || echo -and-more)
    export SPECLA_RUNNING_LOG=$out/running-$name.txt
    timeout "${PART_LIMIT:-280}" python -m pytest -q -n "${WORKERS:-14}" -p no:cacheprovider -p specla_failure_log \
        -rfE --tb=short --junitxml="$out/junit-$name.xml" $part > "$out/pytest-$name.log" 2>&1
    rc=$?
    echo "$part: rc=$rc, $(grep -E '^[0-9]+ (passed|failed)|^=+ .*(passed|failed|error).* =+$' "$out/pytest-$name.log" | tail -1)"
    [ "$rc" = 0 ] || status=$rc
done
grep '^==== ' "$out/failures.txt" 2>/dev/null
exit $status
