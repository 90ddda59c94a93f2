#!/usr/bin/env bash
# On a lent GPU machine (which has torch, triton and transformers but no FLA or pydantic), from
# the repository root:
#   source benchmarks/scripts/device_env.sh [SITE [TREE]]
# installs the wheels carried in .whl/ and a specla tree into SITE (default /tmp/site) and puts
# SITE on PYTHONPATH. TREE defaults to this checkout, installed with examples/third_party_plugin;
# a TREE given is installed alone (benchmarks/scripts/side_by_side.sh installs an earlier
# commit's tree beside this one so). Run with bash instead of sourced, it installs without
# changing the caller's PYTHONPATH. Fetch the wheels here first (Python 3.12, x86-64):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 -d .whl flash-linear-attention==0.6.0 fla-core==0.6.0 \
#     pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
specla_device_env() {  # specla_device_env [SITE [TREE]]: the above (a function, to keep its names local)
  local root site=${1:-/tmp/site} trees
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
  trees=("${2:-$root}")
  [ -n "${2:-}" ] || trees+=("$root/examples/third_party_plugin")
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
      "$root"/.whl/*.whl &&
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade \
      --target "$site" "${trees[@]}" &&
    export PYTHONPATH=$site &&
    python3 -c "import importlib.metadata as m; print({p: m.version(p) for p in ('torch', 'triton', 'transformers', 'flash-linear-attention', 'specla')})"
}
specla_device_env "$@"
