"""The batched reference operators of the GDN plugin against their sequential twins in naive.py."""

import pytest
import torch
import torch.nn.functional as F

from specla.tree import inclusive_ancestor_mask
from specla.ops.naive import root_path
from specla.mixers.gdn.naive import naive_tree_gdn
from specla.mixers.gdn.reference import chunk_gdn, gdn_commit_factor, gdn_commit_replay, node_states, tree_gdn
from trees import SHAPES, TOL, batch_parents, rel_err






def gdn_inputs(B, T, H, HV, K, V, dtype, gen):
    q = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=dtype), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen, dtype=dtype)
    g = -torch.rand(B, T, HV, generator=gen, dtype=dtype) * 0.7  # log decay in (-0.7, 0]
    beta = torch.rand(B, T, HV, generator=gen, dtype=dtype) * 0.9 + 0.05
    S0 = torch.randn(B, HV, K, V, generator=gen, dtype=dtype)
    return q, k, v, g, beta, S0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kind", SHAPES)
@pytest.mark.parametrize("heads", [(2, 2, 4, 3), (1, 3, 5, 4)])  # (H, HV, K, V): equal heads, grouped values
def test_tree_gdn_equals_per_path_recurrence(kind, heads, dtype, rng):
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    H, HV, K, V = heads
    parents = batch_parents(kind, [7, 5, 1], rng)
    q, k, v, g, beta, S0 = gdn_inputs(3, parents.shape[1], H, HV, K, V, dtype, gen)
    mask = inclusive_ancestor_mask(parents)
    o, delta, G = tree_gdn(q, k, v, g, beta, S0, mask, K**-0.5)
    ro, rdelta, rG, rstates = naive_tree_gdn(q, k, v, g, beta, S0, parents, K**-0.5)
    for got, ref in ((o, ro), (delta, rdelta), (G, rG)):
        assert got.dtype == dtype and not got.isnan().any()
        assert rel_err(got, ref) < TOL[dtype]
    assert rel_err(node_states(S0, k, delta, G, mask), rstates) < TOL[dtype]


@pytest.mark.parametrize("kind", SHAPES)
def test_commits_equal_state_after_each_node(kind, rng):
    """For every node as the end of the accepted path: factor and replay commits equal the state
    after walking that node's root path serially; an empty path leaves the state bit-identical."""
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    H, HV, K, V = 1, 2, 4, 3
    parents = batch_parents(kind, [6, 4], rng)
    T = parents.shape[1]
    q, k, v, g, beta, S0 = gdn_inputs(2, T, H, HV, K, V, torch.float64, gen)
    _, delta, G = tree_gdn(q, k, v, g, beta, S0, inclusive_ancestor_mask(parents), K**-0.5)
    _, _, _, rstates = naive_tree_gdn(q, k, v, g, beta, S0, parents, K**-0.5)
    for node in range(T):
        paths = [torch.tensor(root_path(parents[b].tolist(), node)) for b in range(2)]
        path = torch.nn.utils.rnn.pad_sequence(paths, batch_first=True, padding_value=-1)
        plen = torch.tensor([len(p) for p in paths])
        for S in (gdn_commit_factor(S0, k, delta, G, path, plen), gdn_commit_replay(S0, k, v, g, beta, path, plen)):
            assert rel_err(S, rstates[:, node]) < 1e-10
    # ragged: sequence 0 commits nothing (bit-identical), sequence 1 commits its node 0
    path = torch.tensor([[-1], [0]])
    plen = torch.tensor([0, 1])
    for S in (gdn_commit_factor(S0, k, delta, G, path, plen), gdn_commit_replay(S0, k, v, g, beta, path, plen)):
        assert torch.equal(S[0], S0[0])
        assert rel_err(S[1], rstates[1, 0]) < 1e-10


def test_chain_matches_fla_naive_recurrent(rng):
    """On a chain, tree_gdn is the plain recurrence: compare with FLA's own PyTorch reference."""
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

    gen = torch.Generator().manual_seed(7)
    B, T, H, K, V = 2, 9, 2, 8, 6
    q, k, v, g, beta, S0 = gdn_inputs(B, T, H, H, K, V, torch.float64, gen)
    parents = torch.arange(-1, T - 1).expand(B, T)
    o, delta, G = tree_gdn(q, k, v, g, beta, S0, inclusive_ancestor_mask(parents), K**-0.5)
    ro, rS = naive_recurrent_gated_delta_rule(q, k, v, beta, g, scale=K**-0.5, initial_state=S0, output_final_state=True)
    # FLA's naive reference computes in float32 whatever the input dtype
    assert rel_err(o, ro.to(o.dtype)) < 1e-5
    end = torch.full((B,), T - 1)
    path = torch.arange(T).expand(B, T)
    S = gdn_commit_factor(S0, k, delta, G, path, end + 1)
    assert rel_err(S, rS.to(S.dtype)) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("T, chunk", [(45, 16), (16, 16), (5, 8)])  # ragged last chunk, exact, one short chunk
def test_chunk_gdn_equals_sequential_recurrence(T, chunk, dtype, rng):
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    q, k, v, g, beta, S0 = gdn_inputs(2, T, 1, 3, 5, 4, dtype, gen)
    o, S = chunk_gdn(q, k, v, g, beta, S0, 5**-0.5, chunk)
    chain = torch.arange(-1, T - 1).expand(2, T)
    ro, _, _, rstates = naive_tree_gdn(q, k, v, g, beta, S0, chain, 5**-0.5)
    assert o.dtype == dtype and S.dtype == dtype
    assert rel_err(o, ro) < TOL[dtype]
    assert rel_err(S, rstates[:, -1]) < TOL[dtype]


def test_chunk_gdn_gradients_equal_tree_gdn_on_a_chain(rng):
    """Training differentiates through chunk_gdn: its gradients (every input, float64) equal those
    of the one-chunk tree-masked form on the same chain."""
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    T = 21
    inputs = [x.requires_grad_() for x in gdn_inputs(2, T, 2, 2, 4, 3, torch.float64, gen)]
    w = torch.randn(2, T, 2, 3, generator=gen, dtype=torch.float64)
    o, _ = chunk_gdn(*inputs, 0.5, 8)
    grads = torch.autograd.grad((o * w).sum(), inputs)
    mask = inclusive_ancestor_mask(torch.arange(-1, T - 1).expand(2, T))
    ref_o = tree_gdn(*inputs, mask, 0.5)[0]
    ref = torch.autograd.grad((ref_o * w).sum(), inputs)
    for got, want in zip(grads, ref):
        assert rel_err(got, want) < 1e-10
