"""GDN Triton kernels against their naive.py twins (CPU: Triton interpreter, tiny float32 shapes;
GPU: the same cases compiled). Outputs are pre-filled with NaN so an unwritten element fails."""

import random

import pytest
import torch
import torch.nn.functional as F

from specla_gdn.naive import naive_tree_gdn
from specla_gdn.verify import serial_verify

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def inputs(B, T, H, HV, K, V, gen):
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen)
    g = -torch.rand(B, T, HV, generator=gen) * 0.7
    beta = torch.rand(B, T, HV, generator=gen) * 0.9 + 0.05
    S0 = torch.randn(B, HV, K, V, generator=gen)
    return q, k, v, g, beta, S0


def nan_out(B, T, HV, V):
    return (torch.full((B, T, HV, V), float("nan"), device=DEV), torch.full((B, T, HV, V), float("nan"), device=DEV),
            torch.full((B, T, HV), float("nan"), device=DEV))


def chain(B, T):
    return torch.arange(-1, T - 1).expand(B, T)


@pytest.mark.parametrize("shape", [(2, 5, 1, 1, 16, 8), (3, 4, 2, 4, 8, 12), (1, 1, 1, 2, 4, 4)])
def test_serial_verify_equals_naive_chains(shape):
    B, T, H, HV, K, V = shape
    gen = torch.Generator().manual_seed(sum(shape))
    q, k, v, g, beta, S0 = inputs(B, T, H, HV, K, V, gen)
    n = torch.tensor([T] + [random.Random(B).randrange(0, T + 1) for _ in range(B - 1)])
    state = S0.clone().to(DEV)
    out = nan_out(B, T, HV, V)
    o, d, G = serial_verify(*(x.to(DEV) for x in (q, k, v, g, beta)), state, n.to(DEV), K**-0.5, out=out)
    ro, rd, rG, _ = naive_tree_gdn(q, k, v, g, beta, S0, chain(B, T), K**-0.5)
    for b in range(B):
        m = int(n[b])
        for got, ref in ((o, ro), (d, rd), (G, rG)):
            assert not got[b].isnan().any()
            assert torch.allclose(got[b, :m].cpu(), ref[b, :m].float(), rtol=1e-5, atol=1e-5)
            assert not got[b, m:].any()  # padding nodes get zeros
    assert torch.equal(state.cpu(), S0)  # no pending commit: the state is not written


def test_fused_pending_commit_ragged():
    """Batch with ragged pending commits (0..D accepted): the committed state equals the state
    after walking each accepted path serially; 0 leaves it bit-identical; then verify continues
    from the committed state."""
    B, Tp, T, H, HV, K, V = 4, 6, 3, 1, 2, 8, 4
    gen = torch.Generator().manual_seed(5)
    pq, pk, pv, pg, pbeta, S0 = inputs(B, Tp, H, HV, K, V, gen)
    parents = torch.tensor([[-1, 0, 1, 2, 1, 0], [-1, -1, 1, 2, 3, 4], [-1, 0, 0, 0, 3, 3], [-1, 0, 1, 2, 3, 4]])
    _, pdelta, pG, pstates = naive_tree_gdn(pq, pk, pv, pg, pbeta, S0, parents, K**-0.5)
    ends = [4, -1, 5, 5]  # accepted path ends; -1: nothing committed
    paths = []
    for b, e in enumerate(ends):
        p, node = [], e
        while node >= 0:
            p.append(node)
            node = int(parents[b, node])
        paths.append(p[::-1])
    P = max(len(p) for p in paths)
    path = torch.tensor([p + [-1] * (P - len(p)) for p in paths])
    plen = torch.tensor([len(p) for p in paths])
    q, k, v, g, beta, _ = inputs(B, T, H, HV, K, V, gen)
    state = S0.clone().to(DEV)
    pending = tuple(x.to(DEV) for x in (pk, pdelta.float(), pG.float(), path, plen))
    o, d, G = serial_verify(*(x.to(DEV) for x in (q, k, v, g, beta)), state, torch.full((B,), T, device=DEV),
                            K**-0.5, pending=pending, out=nan_out(B, T, HV, V))
    for b, e in enumerate(ends):
        committed = S0[b] if e < 0 else pstates[b, e].float()
        if e < 0:
            assert torch.equal(state[b].cpu(), S0[b])
        else:
            assert torch.allclose(state[b].cpu(), committed, rtol=1e-5, atol=1e-5)
        ro, rd, rG, _ = naive_tree_gdn(q[b : b + 1], k[b : b + 1], v[b : b + 1], g[b : b + 1], beta[b : b + 1],
                                       committed[None], chain(1, T), K**-0.5)
        assert torch.allclose(o[b].cpu(), ro[0].float(), rtol=1e-5, atol=1e-5)
        assert torch.allclose(d[b].cpu(), rd[0].float(), rtol=1e-5, atol=1e-5)


def test_serial_verify_rejects_bad_input():
    gen = torch.Generator().manual_seed(0)
    q, k, v, g, beta, S0 = (x.to(DEV) for x in inputs(1, 2, 1, 1, 4, 4, gen))
    n = torch.full((1,), 2, device=DEV)
    with pytest.raises(ValueError, match="state must be float32"):
        serial_verify(q, k, v, g, beta, S0.double(), n, 0.5)
    with pytest.raises(ValueError, match="g must be float32"):
        serial_verify(q, k, v, g.bfloat16(), beta, S0, n, 0.5)
    with pytest.raises(ValueError, match="num_nodes must be int64"):
        serial_verify(q, k, v, g, beta, S0, n.int(), 0.5)
    q2 = torch.zeros(1, 2, 2, 4, device=DEV)
    with pytest.raises(ValueError, match="HV % H == 0"):
        serial_verify(q2, q2, torch.zeros(1, 2, 3, 4, device=DEV), g, beta, S0, n, 0.5)
