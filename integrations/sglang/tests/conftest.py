"""The SGLang plugin's wiring tests run where SGLang is installed (see integrations/sglang/README.md)
and are skipped, with the reason, everywhere else (the test module's ``importorskip``).

On a CPU, SGLang's Triton kernels and specla's run under Triton's interpreter (set here before
anything imports Triton). SGLang's modules import torchvision; PyPI's torchvision is built against
CUDA torch and fails to import on torch's CPU build because its operator library does not load.
:func:`_import_torchvision` declares the two operators it registers Python-side shapes for, so its
Python part imports (no torchvision operator runs in these tests).
"""

import importlib.util
import os
import sys

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")


def _import_torchvision() -> None:
    if importlib.util.find_spec("torchvision") is None:
        return
    try:
        import torchvision  # noqa: F401
    except RuntimeError:  # "operator torchvision::nms does not exist"
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        lib = torch.library.Library("torchvision", "DEF")
        lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _import_torchvision.lib = lib  # a Library's definitions live as long as the object
        import torchvision  # noqa: F401


if importlib.util.find_spec("sglang") is not None:
    _import_torchvision()
