"""The SGLang plugin's wiring tests run where SGLang is installed (see integrations/sglang/README.md)
and are skipped, with the reason, everywhere else (the test module's skip).

On a CPU, SGLang's Triton kernels and specla's run under Triton's interpreter (set here before
anything imports Triton). SGLang's modules import torchvision at import time (image transforms of
its multimodal configs), which these tests never run. The test environment leaves torchvision out
(PyPI builds it against CUDA torch, and installed beside torch's CPU build it breaks transformers'
model imports for the rest of the suite); :func:`_stub_torchvision` gives SGLang's imports a
placeholder after transformers has recorded torchvision as absent, so transformers never uses it.
"""

import importlib.machinery
import importlib.util
import os
import sys
import types

import torch

os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")


class _AnyMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return cls


class _Any(metaclass=_AnyMeta):
    """Any attribute of a placeholder module, and any attribute of that (``InterpolationMode.X``)."""


class _Placeholder(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Any


def _stub_torchvision() -> None:
    from transformers.utils import import_utils

    if import_utils.is_torchvision_available():  # cached by transformers from here on
        raise RuntimeError("torchvision is absent (find_spec) but transformers found it")
    for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.functional"):
        module = _Placeholder(name)
        module.__spec__, module.__path__ = importlib.machinery.ModuleSpec(name, None), []
        sys.modules[name] = module


if importlib.util.find_spec("sglang") is not None and importlib.util.find_spec("torchvision") is None:
    _stub_torchvision()
