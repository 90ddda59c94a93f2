#!/usr/bin/env bash
# Source on a lent GPU machine (which has torch, triton and transformers but no FLA or pydantic)
# from the repository root: installs the wheels carried in .whl/ and this project into /tmp/site
# and puts it on PYTHONPATH. Fetch the wheels here first (Python 3.12, x86-64):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 -d .whl flash-linear-attention==0.6.0 fla-core==0.6.0 \
#     pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade --target /tmp/site \
    . ./examples/third_party_plugin &&
  export PYTHONPATH=/tmp/site &&
  python3 -c "import importlib.metadata as m; print({p: m.version(p) for p in ('torch', 'triton', 'transformers', 'flash-linear-attention', 'specla')})"
