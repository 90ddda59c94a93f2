"""The process environment of the vLLM plugin's tests, set before anything imports Triton or vLLM:
each test module imports this first (not a ``conftest.py``, whose module name would shadow the
repository's ``tests/conftest.py``, which other test modules import from). ``@triton.jit`` picks
compiled or interpreted kernels where a kernel is defined; vLLM resolves its platform and Triton's
drivers on import.

Where torch sees no GPU: Triton's interpreter (``TRITON_INTERPRET=1``) runs the kernels, vLLM's and
specla's, on the CPU; vLLM's CPU platform (``VLLM_TARGET_DEVICE=cpu``); and an empty
``CUDA_VISIBLE_DEVICES``. vLLM's CPU platform refuses x86 without a Triton driver
(``CpuPlatform.check_and_update_config``), and Triton without a GPU has none; vLLM accepts Triton
with no driver where ``CUDA_VISIBLE_DEVICES`` is empty (``vllm/triton_utils/importing.py``, its
case of a worker whose devices are not yet assigned), so vLLM's modules import Triton itself, not
placeholders. Values already in the environment are kept.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
