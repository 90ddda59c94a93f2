"""The sm_90 compile check of interpreted kernels (tests/hopper_compile.py): a kernel that the
interpreter runs and Triton's compiler rejects fails its launch on the CPU; one that compiles runs."""

import os
import sys

import pytest
import torch

import hopper_compile

pytestmark = pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the check runs where kernels are interpreted")

KERNELS = '''
import triton
import triton.language as tl

SCALE = 3  # a plain global: the interpreter reads it, the compiler refuses it
FACTOR = tl.constexpr(3)


@triton.jit
def plain_global(x, y, n, B: tl.constexpr):
    i = tl.arange(0, B)
    tl.store(y + i, tl.load(x + i, mask=i < n) * SCALE, mask=i < n)


@triton.jit
def constexpr_global(x, y, n, B: tl.constexpr):
    i = tl.arange(0, B)
    tl.store(y + i, tl.load(x + i, mask=i < n) * FACTOR, mask=i < n)
'''


def test_a_kernel_the_compiler_rejects_fails_on_the_cpu(tmp_path, monkeypatch):
    if not hopper_compile.install():
        pytest.skip("Triton's CUDA backend is not installed")
    (tmp_path / "specla_hc_probe.py").write_text(KERNELS)  # a project-like module name: checked
    monkeypatch.syspath_prepend(str(tmp_path))
    import specla_hc_probe as m

    x = torch.randn(5)
    y = torch.full((5,), float("nan"))
    m.constexpr_global[(1,)](x, y, 5, B=8)
    assert torch.equal(y, x * 3)
    with pytest.raises(hopper_compile.KernelDoesNotCompile, match="plain_global does not compile for sm_90"):
        m.plain_global[(1,)](x, y, 5, B=8)
    sys.modules.pop("specla_hc_probe", None)
