"""The Triton activation and gate kernels (``specla.ops.act_triton``) against their PyTorch twins
(``specla.ops.act``), on fresh random inputs, with NaN-prefilled outputs and strided rows (under
``TRITON_INTERPRET=1`` on the CPU, compiled on a GPU)."""

import pytest
import torch

from specla.ops import act, act_triton
from trees import DEV, rel_err

# bf16: two roundings of 2^-8 each (the interpreter truncates where a GPU rounds to nearest)
TOL = {torch.float32: 1e-6, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_kernel_equals_twin(dtype):
    """The gate/up halves of a wider row (strided), inter = 37 (odd), values up to |x| ~ 12."""
    g = torch.Generator().manual_seed(5)
    wide = (torch.randn(3, 4, 2 * 37 + 11, generator=g) * 4).to(dtype).to(DEV)
    gu = wide[..., 11:]
    out = torch.full((3, 4, 37), float("nan"), dtype=dtype, device=DEV)
    got = act_triton.swiglu(gu, 37, out=out)
    ref = act.swiglu(gu, 37)
    assert got is out and not got.isnan().any() and got.dtype == ref.dtype
    assert rel_err(got.double(), ref.double()) < TOL[dtype]
    with pytest.raises(ValueError, match="expected 2 \\* 36"):
        act_triton.swiglu(gu, 36)
    with pytest.raises(ValueError, match="out must be a contiguous"):
        act_triton.swiglu(gu, 37, out=torch.empty(3, 4, 38, dtype=dtype, device=DEV))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("beta_scale", [1.0, 2.0])
def test_gates_kernel_equals_twin(dtype, beta_scale):
    """``a`` and ``b`` as columns of one projection (strided rows), inputs spanning the softplus
    threshold (|a + dt_bias| up to ~30), HV = 5."""
    g = torch.Generator().manual_seed(6)
    z = (torch.randn(2, 7, 40, generator=g) * 12).to(dtype).to(DEV)
    a, b = z[..., 20:25], z[..., 25:30]
    dt_bias = torch.randn(5, generator=g).to(DEV) * 5
    neg_A = -torch.rand(5, generator=g).to(DEV) * 4
    out = tuple(torch.full((2, 7, 5), float("nan"), device=DEV) for _ in range(2))
    got_g, got_b = act_triton.decay_and_sigmoid_gates(a, b, dt_bias, neg_A, beta_scale, out=out)
    ref_g, ref_b = act.decay_and_sigmoid_gates(a, b, dt_bias, neg_A, beta_scale)
    assert got_g is out[0] and got_b is out[1] and not (got_g.isnan().any() or got_b.isnan().any())
    def elementwise(x, y):  # tiny gates too (softplus far left of 0 is tiny): each element relative
        return float(((x.double() - y.double()).abs() / y.double().abs().clamp_min(1e-30)).max())

    assert elementwise(got_g, ref_g) < 1e-5 and elementwise(got_b, ref_b) < 1e-5
    x = a.float() + dt_bias
    assert (x > 20).any() and (x < -18.5).any() and ((x > -18) & (x < -5)).any()  # every softplus branch
    with pytest.raises(ValueError, match="must be float32"):
        act_triton.decay_and_sigmoid_gates(a, b, dt_bias.double(), neg_A)
    with pytest.raises(ValueError, match="out must be two contiguous float32"):
        act_triton.decay_and_sigmoid_gates(a, b, dt_bias, neg_A, out=(out[0].double(), out[1]))


def test_gates_kernel_keeps_nan():
    """A NaN projection gives NaN gates, as in PyTorch (a blown-up model must not get plausible
    decays)."""
    a = torch.tensor([[float("nan"), 1.0]], device=DEV)
    b = torch.tensor([[0.5, float("nan")]], device=DEV)
    z = torch.zeros(2, device=DEV)
    g, beta = act_triton.decay_and_sigmoid_gates(a, b, z, -torch.ones(2, device=DEV))
    rg, rb = act.decay_and_sigmoid_gates(a, b, z, -torch.ones(2, device=DEV))
    assert torch.equal(g.isnan(), rg.isnan()) and torch.equal(beta.isnan(), rb.isnan()) and g.isnan().any()
