"""KDA Triton kernels (``specla.mixers.kda.verify`` and ``commit``) against their PyTorch twins:
the factorized ``reference.py`` and the token-by-token ``naive.py``, both in float64 (CPU: Triton
interpreter, tiny float32 shapes; GPU: the same cases compiled). Fresh random inputs; outputs are
pre-filled with NaN so an unwritten element fails.

Tolerances: the kernels compute in float32; against the float64 twins the largest absolute
differences seen on these inputs (interpreter) are 8e-8 (outputs), 2.4e-7 (deltas), 1.4e-7
(committed states) and 1.1e-6 (path-summed decays, of magnitude up to 18), so the checks take
rtol = atol = 1e-5. The fused commit and the standalone one run the same code: bit-identical
under the interpreter (compiled, within 1e-6)."""

import random

import pytest
import torch
import torch.nn.functional as F

from specla.mixers.kda.naive import kda_tree
from specla.mixers.kda.records import KDAFactorRecord
from specla.mixers.kda.reference import tree_kda
from specla.ops.naive import root_path
from specla.records import LayerCommit
from specla.tree import inclusive_ancestor_mask
from trees import DEV, SHAPES, needs_triton, tree_parents

pytestmark = needs_triton
TOL = dict(rtol=1e-5, atol=1e-5)
SAME_CODE = dict(rtol=0, atol=0) if DEV == "cpu" else dict(rtol=1e-6, atol=1e-6)  # fused vs standalone commit


def kda_inputs(B, T, H, K, V, gen, dtype=torch.float64):
    """q (L2-normalised, scaled by ``K ** -0.5``), k (L2-normalised), v, per-channel log decays in
    (-2, 0], beta in (0.05, 0.95) and a committed state, all random."""
    q = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=dtype), dim=-1) * K**-0.5
    k = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen, dtype=dtype)
    g = -2 * torch.rand(B, T, H, K, generator=gen, dtype=dtype)
    beta = torch.rand(B, T, H, generator=gen, dtype=dtype) * 0.9 + 0.05
    return q, k, v, g, beta, torch.randn(B, H, K, V, generator=gen, dtype=dtype)


def on_dev(*xs):
    """``xs`` in float32 (floating ones) on the test device."""
    return [x.to(DEV, torch.float32) if x.is_floating_point() else x.to(DEV) for x in xs]


def nan_out(B, T, H, K, V):
    nan = lambda *s: torch.full(s, float("nan"), device=DEV)  # noqa: E731
    return nan(B, T, H, V), nan(B, T, H, V), nan(B, T, H, K)


def chain(B, T):
    return torch.arange(-1, T - 1).expand(B, T)


def layer_commit(k, delta, Gk, path, path_len):
    """A pending commit as the verify kernels take it (float32 on the test device)."""
    k, delta, Gk, path, path_len = on_dev(k, delta, Gk, path, path_len)
    return LayerCommit(KDAFactorRecord(k=k, delta=delta, Gk=Gk, conv_x=None), path, path_len)


def padded_paths(parents, ends):
    """Root paths ending at ``ends`` (``-1``: nothing accepted) as ``(path [B, P], path_len [B])``."""
    paths = [root_path(parents[b].tolist(), e) if e >= 0 else [] for b, e in enumerate(ends)]
    P = max(len(p) for p in paths)
    return torch.tensor([p + [-1] * (P - len(p)) for p in paths]), torch.tensor([len(p) for p in paths])


@pytest.fixture
def small_tiles(monkeypatch):
    """16-wide K blocks and V tiles, so that K = V = 20 takes two of each (the blocks' edges and
    the masked tails are exercised at tiny shapes)."""
    import specla.mixers.kda.verify as kv

    monkeypatch.setitem(kv.TUNING, "tree", {**kv.TUNING["tree"], "BKC": 16, "BV": 16})
    monkeypatch.setitem(kv.TUNING, "serial", {**kv.TUNING["serial"], "BV": 16})


@pytest.fixture(params=["fused", "separate"])
def prepare(request, monkeypatch):
    """Both forms of the tree kernel's substitution matrices A and Q: built column by column in
    each verify program (``fused``), or a row a program by a prepare launch whose results every V
    tile loads (``separate``)."""
    import specla.mixers.kda.verify as kv

    monkeypatch.setitem(kv.TUNING, "tree", {**kv.TUNING["tree"], "prepare": request.param})
    return request.param


@pytest.mark.parametrize("kind", SHAPES)
def test_tree_verify_equals_reference_and_naive(kind, small_tiles, prepare):
    """A ragged batch of two trees of ``kind`` (9 and 5 nodes, the second padded with roots):
    every node's output, delta and path-summed decay equal ``tree_kda``'s and the token-by-token
    twin's along its root path; every output element is written; the state is not."""
    from specla.mixers.kda.verify import tree_verify

    rng = random.Random(len(kind) * 7)
    sizes = [1, 1] if kind == "single" else [9, 5]
    T, H, K, V = max(sizes), 2, 20, 20
    parents = torch.tensor([tree_parents(kind, n, rng) + [-1] * (T - n) for n in sizes])
    q, k, v, g, beta, S0 = kda_inputs(2, T, H, K, V, torch.Generator().manual_seed(rng.randrange(2**31)))
    mask = inclusive_ancestor_mask(parents)
    state = on_dev(S0)[0]
    got = tree_verify(*on_dev(q, k, v, g, beta), state, mask.to(DEV), out=nan_out(2, T, H, K, V))
    ref_o, ref_d, ref_G = tree_kda(q, k, v, g, beta, S0, mask)
    naive_o, _, naive_d = kda_tree(q, k, v, g, beta, S0, parents)
    for x, ref in zip(got, (ref_o, ref_d, ref_G)):
        assert not x.isnan().any()
        torch.testing.assert_close(x.cpu().double(), ref, **TOL)
    torch.testing.assert_close(got[0].cpu().double(), naive_o, **TOL)
    torch.testing.assert_close(got[1].cpu().double(), naive_d, **TOL)
    assert torch.equal(state.cpu(), S0.float())  # no pending commit: the state is not written


def test_serial_verify_equals_naive_ragged_chains(small_tiles):
    """Chains of 5, 2 and 0 nodes in one batch: the real nodes equal the token-by-token twin,
    the padding nodes get zeros (written: nothing stays NaN), the state is not written."""
    from specla.mixers.kda.verify import serial_verify

    B, T, H, K, V = 3, 5, 2, 20, 20
    q, k, v, g, beta, S0 = kda_inputs(B, T, H, K, V, torch.Generator().manual_seed(3))
    n = torch.tensor([5, 2, 0])
    state = on_dev(S0)[0]
    got = serial_verify(*on_dev(q, k, v, g, beta), state, n.to(DEV), out=nan_out(B, T, H, K, V))
    ref_o, _, ref_d = kda_tree(q, k, v, g, beta, S0, chain(B, T))
    _, _, ref_G = tree_kda(q, k, v, g, beta, S0, inclusive_ancestor_mask(chain(B, T)))
    for x, ref in zip(got, (ref_o, ref_d, ref_G)):
        assert not x.isnan().any()
        for b in range(B):
            m = int(n[b])
            torch.testing.assert_close(x[b, :m].cpu().double(), ref[b, :m], **TOL)
            assert not x[b, m:].any()  # padding nodes get zeros
    assert torch.equal(state.cpu(), S0.float())


@pytest.mark.parametrize("kernel", ["serial", "parallel", "prepared", "flush"])
def test_pending_commit_ragged(kernel, monkeypatch):
    """A ragged pending commit (4, 0, 3 and 4 accepted nodes of the previous step's trees): the
    committed state equals the twin's state after each accepted path; nothing accepted leaves a
    row bit-identical; the fused commit (``serial``, ``parallel``) equals the standalone commit
    (``flush_commit``) followed by a verify without one, and the verify then continues from the
    committed state as the twin does (``prepared``: the tree kernel with its prepare launch)."""
    from specla.mixers.kda.commit import flush_commit
    from specla.mixers.kda import verify as kv
    from specla.mixers.kda.verify import serial_verify, tree_verify

    if kernel in ("parallel", "prepared"):  # each form of the tree kernel, whichever is the default
        monkeypatch.setitem(kv.TUNING, "tree", {**kv.TUNING["tree"],
                                                "prepare": "separate" if kernel == "prepared" else "fused"})

    B, Tp, T, H, K, V = 4, 6, 3, 2, 12, 6
    gen = torch.Generator().manual_seed(5)
    pq, pk, pv, pg, pbeta, S0 = kda_inputs(B, Tp, H, K, V, gen)
    parents = torch.tensor([[-1, 0, 1, 2, 1, 0], [-1, -1, 1, 2, 3, 4], [-1, 0, 0, 0, 3, 3], [-1, 0, 1, 2, 3, 4]])
    _, pdelta, pGk = tree_kda(pq, pk, pv, pg, pbeta, S0, inclusive_ancestor_mask(parents))
    _, pstates, _ = kda_tree(pq, pk, pv, pg, pbeta, S0, parents)
    ends = [4, -1, 5, 3]
    pending = layer_commit(pk, pdelta, pGk, *padded_paths(parents, ends))
    q, k, v, g, beta, _ = kda_inputs(B, T, H, K, V, gen)
    args = on_dev(q, k, v, g, beta)
    mask = inclusive_ancestor_mask(chain(B, T)).to(DEV)

    def verify(state, pend):
        if kernel == "serial":
            return serial_verify(*args, state, torch.full((B,), T, device=DEV), pending=pend, out=nan_out(B, T, H, K, V))
        return tree_verify(*args, state, mask, pending=pend, out=nan_out(B, T, H, K, V))

    state = on_dev(S0)[0]
    if kernel == "flush":
        assert flush_commit(state, pending) is state
    else:
        fused = verify(state, pending)
        flushed = on_dev(S0)[0]
        flush_commit(flushed, pending)
        torch.testing.assert_close(state, flushed, **SAME_CODE)
        for x, y in zip(fused, verify(flushed, None)):
            torch.testing.assert_close(x, y, **SAME_CODE)
    for b, e in enumerate(ends):
        if e < 0:
            assert torch.equal(state[b].cpu(), S0[b].float())
            committed = S0[b]
        else:
            committed = pstates[b, e]
            torch.testing.assert_close(state[b].cpu().double(), committed, **TOL)
        if kernel != "flush":
            ro, _, rd = kda_tree(q[b:b + 1], k[b:b + 1], v[b:b + 1], g[b:b + 1], beta[b:b + 1], committed[None],
                                 chain(1, T))
            torch.testing.assert_close(fused[0][b].cpu().double(), ro[0], **TOL)
            torch.testing.assert_close(fused[1][b].cpu().double(), rd[0], **TOL)


@pytest.mark.parametrize("kernel", ["serial", "parallel"])
def test_a_pending_path_of_width_zero_commits_nothing(kernel):
    """A pending commit whose path is ``[B, 0]``: the same outputs as without a pending commit,
    bit for bit, and the state bit-identical."""
    from specla.mixers.kda.verify import serial_verify, tree_verify

    B, Tp, T, H, K, V = 2, 3, 4, 1, 8, 6
    gen = torch.Generator().manual_seed(29)
    _, pk, pv, pg, _, _ = kda_inputs(B, Tp, H, K, V, gen)
    pending = layer_commit(pk, pv, pg.cumsum(1), torch.empty(B, 0, dtype=torch.int64), torch.zeros(B, dtype=torch.int64))
    q, k, v, g, beta, S0 = kda_inputs(B, T, H, K, V, gen)
    args = on_dev(q, k, v, g, beta)
    state, plain = on_dev(S0)[0], on_dev(S0)[0]

    def run(st, pend):
        if kernel == "serial":
            return serial_verify(*args, st, torch.full((B,), T, device=DEV), pending=pend, out=nan_out(B, T, H, K, V))
        return tree_verify(*args, st, inclusive_ancestor_mask(chain(B, T)).to(DEV), pending=pend,
                           out=nan_out(B, T, H, K, V))

    for got, ref in zip(run(state, pending), run(plain, None)):
        assert torch.equal(got, ref)
    assert torch.equal(state.cpu(), S0.float())


def test_kernels_reject_bad_input():
    """Wrong dtypes, shapes or layouts raise ValueError naming what is expected, before any launch."""
    from specla.mixers.kda.commit import flush_commit
    from specla.mixers.kda.verify import serial_verify, tree_verify

    q, k, v, g, beta, S0 = on_dev(*kda_inputs(1, 3, 1, 4, 4, torch.Generator().manual_seed(0)))
    n = torch.full((1,), 3, device=DEV)
    mask = inclusive_ancestor_mask(chain(1, 3)).to(DEV)
    with pytest.raises(ValueError, match=r"^state must be float32 \[1, 1, 4, 4\], got torch.float64"):
        serial_verify(q, k, v, g, beta, S0.double(), n)
    with pytest.raises(ValueError, match=r"^g must be float32 \[1, 3, 1, 4\], got torch.bfloat16"):
        serial_verify(q, k, v, g.bfloat16(), beta, S0, n)
    with pytest.raises(ValueError, match=r"^beta must be float32 \[1, 3, 1\], got torch.float32 \[1, 3\]"):
        tree_verify(q, k, v, g, beta[..., 0], S0, mask)
    with pytest.raises(ValueError, match=r"^num_nodes must be int64 \[1\]"):
        serial_verify(q, k, v, g, beta, S0, n.int())
    with pytest.raises(ValueError, match=r"v \[B, T, H, V\]; got"):
        serial_verify(q, k, v.expand(1, 3, 2, 4), g, beta, S0, n)
    with pytest.raises(ValueError, match=r"^mask must be bool \[1, 3, 3\], got torch.float32"):
        tree_verify(q, k, v, g, beta, S0, mask.float())
    with pytest.raises(ValueError, match="^state must be contiguous"):
        tree_verify(q, k, v, g, beta, S0.transpose(2, 3), mask)
    big = torch.zeros(1, 65, 1, 4, device=DEV)
    with pytest.raises(ValueError, match="^tree_verify handles at most 64 nodes, got 65"):
        tree_verify(big, big, big, big, torch.zeros(1, 65, 1, device=DEV), S0,
                    torch.ones(1, 65, 65, dtype=torch.bool, device=DEV))
    path, plen = torch.zeros(1, 1, dtype=torch.int64, device=DEV), torch.ones(1, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match=r"^pending must be a LayerCommit of a KDAFactorRecord \(k \[B, Tp, 1, 4\], "
                                         r"delta \[B, Tp, 1, 4\] f32, Gk \[B, Tp, 1, 4\] f32\)"):
        flush_commit(S0, LayerCommit(KDAFactorRecord(k=k, delta=v, Gk=g.double(), conv_x=None), path, plen))
    with pytest.raises(ValueError, match="^state must be a contiguous float32 \\[B, H, K, V\\], got torch.float64"):
        flush_commit(S0.double(), layer_commit(k, v, g, path, plen))
    with pytest.raises(ValueError, match="^pending must be a LayerCommit of a KDAFactorRecord, got tuple$"):
        flush_commit(S0, (k, v, g, path, plen))


def test_an_unknown_prepare_form_is_refused_before_any_launch(monkeypatch):
    from specla.mixers.kda import verify as kv

    B, T, H, K, V = 1, 3, 1, 4, 4
    q, k, v, g, beta, S0 = on_dev(*kda_inputs(B, T, H, K, V, torch.Generator().manual_seed(3)))
    out = nan_out(B, T, H, K, V)
    monkeypatch.setitem(kv.TUNING, "tree", {**kv.TUNING["tree"], "prepare": "rows"})
    with pytest.raises(ValueError, match='^TUNING\\["tree"\\]\\["prepare"\\] must be one of \'fused\', '
                                         '\'separate\', got \'rows\'$'):
        kv.tree_verify(q, k, v, g, beta, S0, inclusive_ancestor_mask(chain(B, T)).to(DEV), out=out)
    assert all(x.isnan().all() for x in out)  # nothing launched


@pytest.mark.parametrize("kernel", ["serial", "parallel", "prepared"])
def test_kernels_at_the_kimi_linear_head_shape(kernel, monkeypatch):
    """K = V = 128 (Kimi Linear's KDA heads), the default tiles (the tree kernel's K blocks and V
    tiles, the serial kernel's [128, BV] state tile; on a CPU also compiled for sm_90 at these
    sizes), one head: a 9-node tree or a 4-node chain after a pending commit of 3 accepted nodes
    equals the float64 twins (``prepared``: the tree kernel with its prepare launch)."""
    from specla.mixers.kda import verify as kv
    from specla.mixers.kda.verify import serial_verify, tree_verify

    if kernel in ("parallel", "prepared"):  # each form of the tree kernel, whichever is the default
        monkeypatch.setitem(kv.TUNING, "tree", {**kv.TUNING["tree"],
                                                "prepare": "separate" if kernel == "prepared" else "fused"})
    B, Tp, H, K, V = 1, 4, 1, 128, 128
    T = 4 if kernel == "serial" else 9
    gen = torch.Generator().manual_seed(41)
    pq, pk, pv, pg, pbeta, S0 = kda_inputs(B, Tp, H, K, V, gen)
    pparents = chain(B, Tp)
    _, pdelta, pGk = tree_kda(pq, pk, pv, pg, pbeta, S0, inclusive_ancestor_mask(pparents))
    _, pstates, _ = kda_tree(pq, pk, pv, pg, pbeta, S0, pparents)
    pending = layer_commit(pk, pdelta, pGk, *padded_paths(pparents, [2]))
    parents = torch.tensor([tree_parents("chain" if kernel == "serial" else "random", T, random.Random(4))])
    q, k, v, g, beta, _ = kda_inputs(B, T, H, K, V, gen)
    state = on_dev(S0)[0]
    if kernel == "serial":
        got = serial_verify(*on_dev(q, k, v, g, beta), state, torch.full((B,), T, device=DEV), pending=pending,
                            out=nan_out(B, T, H, K, V))
    else:
        got = tree_verify(*on_dev(q, k, v, g, beta), state, inclusive_ancestor_mask(parents).to(DEV), pending=pending,
                          out=nan_out(B, T, H, K, V))
    torch.testing.assert_close(state.cpu().double(), pstates[:, 2], **TOL)
    ref = tree_kda(q, k, v, g, beta, pstates[:, 2], inclusive_ancestor_mask(parents))
    for x, r in zip(got, ref):
        assert not x.isnan().any()
        torch.testing.assert_close(x.cpu().double(), r, **TOL)
