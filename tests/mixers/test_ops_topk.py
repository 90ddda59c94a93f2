"""The top-k log-softmax kernel (``specla.ops.topk_triton``) against its PyTorch twin
(``specla.ops.topk``), on fresh random inputs, with NaN-prefilled outputs (under
``TRITON_INTERPRET=1`` on the CPU, compiled on a GPU)."""

import pytest
import torch

from specla.ops import topk, topk_triton
from trees import DEV

TOL = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 2e-6}


def _nan_out(shape, k, dtype):
    ct = torch.float64 if dtype == torch.float64 else torch.float32
    return (torch.full((*shape, k), float("nan"), dtype=ct, device=DEV),
            torch.full((*shape, k), -7, dtype=torch.int64, device=DEV))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("V, k", [(2500, 4), (1000, 1), (1030, 7), (5, 5)])
def test_kernel_equals_twin(dtype, V, k):
    """Rows taken from a wider tensor (strided); V spanning several blocks, one partial block,
    k = V. Equal ids, values within TOL."""
    g = torch.Generator().manual_seed(V + k)
    wide = (torch.randn(3, 5, V + 9, generator=g) * 4).to(dtype).to(DEV)
    x = wide[..., 9:]
    out = _nan_out((3, 5), k, dtype)
    got = topk_triton.log_softmax_topk(x, k, out=out)
    ref = topk.log_softmax_topk(x, k)
    assert got[0] is out[0] and got[0].dtype == ref[0].dtype and not got[0].isnan().any()
    assert torch.equal(got[1], ref[1])
    assert float((got[0] - ref[0]).abs().max()) < TOL[dtype]


def test_ties_go_to_the_smaller_id():
    """bfloat16 logits drawn from a handful of values (many ties, also across blocks) and
    ``-inf`` entries, some rows with fewer finite entries than k: the same ids as the twin."""
    g = torch.Generator().manual_seed(5)
    V, k = 2100, 6
    x = torch.randint(0, 4, (4, V), generator=g).to(torch.bfloat16)
    x[1, :] = float("-inf")
    x[1, [3, 1500, 7]] = torch.tensor([1.0, 2.0, 1.0], dtype=torch.bfloat16)  # 3 finite entries < k
    x[2, 1024:] = float("-inf")
    x = x.to(DEV)
    got, ref = topk_triton.log_softmax_topk(x, k), topk.log_softmax_topk(x, k)
    assert torch.equal(got[1], ref[1])
    assert got[1][1, :3].tolist() == [1500, 3, 7]
    finite = ref[0].isfinite()
    assert torch.equal(got[0].isfinite(), finite) and float((got[0] - ref[0])[finite].abs().max()) < 2e-6


def test_large_k_takes_the_twin_and_bad_k_is_refused():
    x = torch.randn(2, 40, device=DEV)
    k = topk_triton.MAX_K + 1
    assert all(torch.equal(a, b) for a, b in zip(topk_triton.log_softmax_topk(x, k), topk.log_softmax_topk(x, k)))
    for bad in (0, 41):
        for fn in (topk_triton.log_softmax_topk, topk.log_softmax_topk):
            with pytest.raises(ValueError, match="k must be in 1..40"):
                fn(x, bad)


def test_large_logits_and_near_ties():
    """Log-probabilities of large logits keep their precision (the shift comes first: a row of
    the smallest float32 is uniform, not probability 1 each), and two logits that round to the
    same log-probability keep their logit order in both forms."""
    big = torch.full((1, 1025), torch.finfo(torch.float32).min, device=DEV)
    want = -torch.log(torch.tensor(1025.0))
    for fn in (topk_triton.log_softmax_topk, topk.log_softmax_topk):
        assert torch.allclose(fn(big, 2)[0].cpu(), want.expand(1, 2), atol=1e-5)
    g = torch.Generator().manual_seed(8)
    for offset in (1e3, -1e6):
        x = (torch.randn(4, 3000, generator=g) + offset).to(DEV)
        assert float((topk_triton.log_softmax_topk(x, 4)[0] - topk.log_softmax_topk(x, 4)[0]).abs().max()) < 2e-6
    near = torch.zeros(1, 1100, device=DEV)
    near[0, 1] = 1e-8
    assert topk_triton.log_softmax_topk(near, 3)[1].tolist() == topk.log_softmax_topk(near, 3)[1].tolist() == [[1, 0, 2]]


def test_nan_logits_give_real_token_ids():
    """A row of NaN logits (a drafter's overflow), and a row with NaN among numbers, across
    blocks: the kernel counts NaN as ``-inf``, so every id is a real token (an all-NaN row once
    gave the "no entry" id ``2**31 - 1``, which the tree then looked up); the numbers of a mixed
    row keep their order."""
    from specla.ops import draft_tree_triton as dt

    x = torch.randn(3, 2100, generator=torch.Generator().manual_seed(9)).to(DEV)
    x[0] = float("nan")
    x[1, ::3] = float("nan")
    values, ids = topk_triton.log_softmax_topk(x, 4)
    assert ((ids >= 0) & (ids < 2100)).all()
    assert ids[0].tolist() == [0, 1, 2, 3] and not (values[0] > float("-inf")).any()  # NaN, as the twin's
    clean = x[1].clone()
    clean[::3] = float("-inf")
    assert ids[1].tolist() == topk.log_softmax_topk(clean[None], 4)[1][0].tolist()
    rows = (torch.empty(3, 4, device=DEV), *(torch.empty(3, 4, dtype=torch.int64, device=DEV) for _ in range(2)))
    slot, tok, nid, score = dt.topk_level(None, x[:, None], None, 4, 0, False, *rows)
    assert ((rows[1] >= 0) & (rows[1] < 2100)).all() and ((tok >= 0) & (tok < 2100)).all()


def test_a_wrong_out_is_refused():
    x = torch.randn(6, 1100, device=DEV)
    small = (torch.empty(1, 4, device=DEV), torch.empty(1, 4, dtype=torch.int64, device=DEV))
    strided = (torch.empty(6, 8, device=DEV)[:, ::2], torch.empty(6, 4, dtype=torch.int64, device=DEV))
    for out in (small, strided):
        with pytest.raises(ValueError, match=r"out must be 2 contiguous tensors of shape \(6, 4\)"):
            topk_triton.log_softmax_topk(x, 4, out=out)
