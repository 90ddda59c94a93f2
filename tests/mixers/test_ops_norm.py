"""The Triton norm kernels (``specla.ops.norm_triton``) against their PyTorch twins
(``specla.ops.norm``), on fresh random inputs, with NaN-prefilled outputs, strided rows and every
dtype the plugins use (under ``TRITON_INTERPRET=1`` on the CPU, compiled on a GPU)."""

import pytest
import torch

from specla.ops import norm, norm_triton
from trees import DEV, rel_err

TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gated,unit_offset", [(None, False), ("swish", False), ("sigmoid", False), (None, True)])
def test_rms_norm_kernel_equals_twin(dtype, gated, unit_offset):
    """Rows taken from a wider projection (strided), D = 48 (not a power of two); also the
    zero-centred form (``1 + weight``)."""
    g = torch.Generator().manual_seed(3)
    wide = (torch.randn(3, 5, 2, 80, generator=g) * 3).to(dtype).to(DEV)
    x = wide[..., 7:55]  # [3, 5, 2, 48], row stride 80
    w = torch.randn(48, generator=g).to(dtype).to(DEV)
    gate = torch.randn(3, 5, 2 * 48 + 9, generator=g).to(dtype).to(DEV)[..., 9:].view(3, 5, 2, 48) if gated else None
    out_dtype = torch.float32 if dtype == torch.bfloat16 and gated else None
    ct = torch.float64 if dtype == torch.float64 else torch.float32
    out = torch.full(x.shape, float("nan"), dtype=out_dtype or (ct if gated else dtype), device=DEV)
    got = norm_triton.rms_norm(x, w, 1e-6, gate, gated or "swish", out_dtype=out_dtype, out=out, unit_offset=unit_offset)
    ref = norm.gated_rms_norm(x, w, 1e-6, gate, gated, out_dtype) if gated else norm.rms_norm(x, w, 1e-6, unit_offset)
    assert got is out and got.dtype == ref.dtype and not got.isnan().any()
    assert rel_err(got.double(), ref.double()) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_l2norm_pair_kernel_equals_twin(dtype):
    """q and k heads of a [q ; k ; v] projection (strided tokens), in the compute dtype."""
    g = torch.Generator().manual_seed(4)
    B, T, H, K = 2, 3, 3, 20
    x = torch.randn(B, T, 2 * H * K + 17, generator=g).to(dtype).to(DEV)
    q, k = norm_triton.l2norm_pair(x, H, K)
    rq = norm.l2norm(x[..., : H * K].reshape(B, T, H, K))
    rk = norm.l2norm(x[..., H * K : 2 * H * K].reshape(B, T, H, K))
    assert q.dtype == rq.dtype and k.dtype == rk.dtype and q.shape == (B, T, H, K)
    assert not q.isnan().any() and not k.isnan().any()
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    assert rel_err(q.double(), rq.double()) < tol and rel_err(k.double(), rk.double()) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_centred_rms_norm_equals_transformers_qwen_norm(dtype):
    """The zero-centred form (twin and kernel) against transformers' own ``Qwen3_5RMSNorm`` (the
    oracle), on a weight around 0 as the checkpoints store it."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    g = torch.Generator().manual_seed(5)
    mod = Qwen3_5RMSNorm(40, eps=1e-6).to(dtype).to(DEV)
    with torch.no_grad():
        mod.weight.copy_(torch.randn(40, generator=g) * 0.1)
    x = (torch.randn(3, 7, 40, generator=g) * 2).to(dtype).to(DEV)
    want = mod(x)
    out = torch.full(x.shape, float("nan"), dtype=dtype, device=DEV)
    for got in (norm.rms_norm(x, mod.weight, mod.eps, unit_offset=True),
                norm_triton.rms_norm(x, mod.weight, mod.eps, out=out, unit_offset=True)):
        assert got.dtype == dtype and not got.isnan().any()
        assert rel_err(got.double(), want.double()) < TOL[dtype]


def test_norm_kernels_reject_bad_shapes():
    x = torch.randn(2, 8, device=DEV)
    with pytest.raises(ValueError, match="weight"):
        norm_triton.rms_norm(x, torch.ones(7, device=DEV), 1e-6)
    with pytest.raises(ValueError, match="activation"):
        norm_triton.rms_norm(x, torch.ones(8, device=DEV), 1e-6, x, "relu")
    with pytest.raises(ValueError, match="fewer than"):
        norm_triton.l2norm_pair(torch.randn(1, 2, 10, device=DEV), 2, 3)
