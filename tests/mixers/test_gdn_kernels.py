"""GDN Triton kernels against their naive.py twins (CPU: Triton interpreter, tiny float32 shapes;
GPU: the same cases compiled). Outputs are pre-filled with NaN so an unwritten element fails."""

import random

import pytest
import torch
import torch.nn.functional as F

from specla.ops.naive import root_path
from specla.mixers.gdn.naive import naive_tree_gdn
from specla.mixers.gdn.verify import hybrid_verify, serial_verify
from trees import DEV



def layer_commit(k, delta, G, path, path_len):
    """A pending commit on ``DEV`` as the verify kernels take it."""
    from specla.records import LayerCommit
    from specla.mixers.gdn.records import GDNFactorRecord

    return LayerCommit(GDNFactorRecord(k=k.to(DEV), delta=delta.to(DEV), G=G.to(DEV), conv_x=None), path.to(DEV),
                       path_len.to(DEV))

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


@pytest.mark.parametrize("shape", [(2, 5, 1, 1, 16, 8), (3, 4, 2, 4, 8, 12), (1, 1, 1, 2, 4, 4), (4, 1, 2, 4, 8, 40)])
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


@pytest.mark.parametrize("T", [3, 1])
def test_fused_pending_commit_ragged(T):
    """Batch with ragged pending commits (0..D accepted): the committed state equals the state
    after walking each accepted path serially; 0 leaves it bit-identical; then verify continues
    from the committed state (a chain of 3, or one token: plain decoding's form)."""
    B, Tp, H, HV, K, V = 4, 6, 1, 2, 8, 4
    gen = torch.Generator().manual_seed(5)
    pq, pk, pv, pg, pbeta, S0 = inputs(B, Tp, H, HV, K, V, gen)
    parents = torch.tensor([[-1, 0, 1, 2, 1, 0], [-1, -1, 1, 2, 3, 4], [-1, 0, 0, 0, 3, 3], [-1, 0, 1, 2, 3, 4]])
    _, pdelta, pG, pstates = naive_tree_gdn(pq, pk, pv, pg, pbeta, S0, parents, K**-0.5)
    ends = [4, -1, 5, 5]  # accepted path ends; -1: nothing committed
    paths = [root_path(parents[b].tolist(), e) for b, e in enumerate(ends)]
    P = max(len(p) for p in paths)
    path = torch.tensor([p + [-1] * (P - len(p)) for p in paths])
    plen = torch.tensor([len(p) for p in paths])
    q, k, v, g, beta, _ = inputs(B, T, H, HV, K, V, gen)
    state = S0.clone().to(DEV)
    pending = layer_commit(pk, pdelta.float(), pG.float(), path, plen)
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


from specla.tree import inclusive_ancestor_mask  # noqa: E402
from specla.mixers.gdn.verify import tree_verify  # noqa: E402
import specla.mixers.gdn.verify as gdn_verify  # noqa: E402
from trees import SHAPES, f64, ragged_pending, rel_err, tree_parents  # noqa: E402


@pytest.fixture(params=["fused", "separate"])
def prepare(request, monkeypatch):
    """Both forms of the tree kernel's ``T = (I + A)^-1`` and ``G``: computed in each verify program
    (``fused``) or by a separate prepare launch whose results every V tile loads."""
    monkeypatch.setitem(gdn_verify.TUNING, "tree", {**gdn_verify.TUNING["tree"], "prepare": request.param})
    return request.param


@pytest.fixture(params=gdn_verify.INVERSE_FORMS)
def inverse(request, monkeypatch):
    """Every form of the forward substitution giving ``T = (I + A)^-1``: row by row, by blocks
    of 16 rows (trees of more than 16 nodes have off-diagonal blocks), or level by level."""
    monkeypatch.setitem(gdn_verify.TUNING, "tree", {**gdn_verify.TUNING["tree"], "inverse": request.param})
    return request.param


@pytest.mark.parametrize("kind", SHAPES)
@pytest.mark.parametrize("heads", [(1, 1, 16, 8), (2, 4, 8, 12)])
def test_tree_verify_equals_naive(kind, heads, prepare):
    H, HV, K, V = heads
    rng = random.Random(len(kind) * 7 + K)
    sizes = [1, 1] if kind == "single" else [9, 5]
    T = max(sizes)
    parents = torch.tensor([tree_parents(kind, n, rng) + [-1] * (T - n) for n in sizes])
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    q, k, v, g, beta, S0 = inputs(2, T, H, HV, K, V, gen)
    state = S0.clone().to(DEV)
    mask = inclusive_ancestor_mask(parents)
    o, d, G = tree_verify(*(x.to(DEV) for x in (q, k, v, g, beta)), state, mask.to(DEV), K**-0.5,
                          out=nan_out(2, T, HV, V))
    ro, rd, rG, _ = naive_tree_gdn(q, k, v, g, beta, S0, parents, K**-0.5)
    for got, ref in ((o, ro), (d, rd), (G, rG)):
        assert not got.isnan().any()
        assert torch.allclose(got.cpu(), ref.float(), rtol=1e-4, atol=1e-5)
    assert torch.equal(state.cpu(), S0)


@pytest.mark.parametrize("T,g,beta", [(33, -0.05, 1.9), (64, -0.01, 0.9)])
def test_tree_verify_stays_accurate_on_deep_chains_of_correlated_keys(T, g, beta, prepare, inverse):
    """A chain of 33 or 64 nodes whose keys are correlated (mean cosine about 0.5), with weak decay
    and a large ``beta`` (1.9: negative eigenvalues allowed): the powers of ``A`` grow large and
    cancel, so an inverse of ``I + A`` as a Neumann product loses every digit in float32 (errors
    of 1 to 5 times the output's scale were measured), where forward substitution, row by row or
    blocked, stays near the serial kernel's 1e-6 (up to 5.3e-7 seen under the interpreter)."""
    B, H, HV, K, V = 2, 1, 1, 64, 16
    gen = torch.Generator().manual_seed(0)
    parents = chain(B, T)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = F.normalize(1.0 + torch.randn(B, T, H, K, generator=gen), dim=-1)
    gg, bb = torch.full((B, T, HV), g), torch.full((B, T, HV), beta)
    v, S0 = torch.randn(B, T, HV, V, generator=gen), torch.randn(B, HV, K, V, generator=gen)
    o, _, _ = tree_verify(*(x.to(DEV) for x in (q, k, v, gg, bb)), S0.clone().to(DEV),
                          inclusive_ancestor_mask(parents).to(DEV), K**-0.5, out=nan_out(B, T, HV, V))
    ro, _, _, _ = naive_tree_gdn(*(x.double() for x in (q, k, v, gg, bb, S0)), parents, K**-0.5)
    assert float((o.cpu().double() - ro).abs().max() / ro.abs().max()) < 5e-6


@pytest.mark.parametrize("kernel", ["serial", "parallel"])
@pytest.mark.parametrize("T", [5, 1])
def test_values_read_in_place_from_a_wider_projection(kernel, T):
    """``v`` as the mixer passes it: a slice of each token's wider projection (no copy; one token
    per sequence included, where the batch stride is the token stride). Outputs equal those of the
    same values made contiguous, bit for bit, and the sequential twin's."""
    B, H, HV, K, V = 3, 1, 2, 8, 6
    gen = torch.Generator().manual_seed(11)
    q, k, v, g, beta, S0 = inputs(B, T, H, HV, K, V, gen)
    wide = torch.randn(B, T, 3 * HV * V, generator=gen)
    wide[..., HV * V : 2 * HV * V] = v.flatten(2)
    strided = wide.to(DEV)[..., HV * V : 2 * HV * V].reshape(B, T, HV, V)
    assert not strided.is_contiguous() and gdn_verify._value_rows(strided)[0] is strided  # read in place
    parents = chain(B, T)
    outs = []
    for vv in (strided, v.to(DEV)):
        args = (*(x.to(DEV) for x in (q, k)), vv, *(x.to(DEV) for x in (g, beta)), S0.clone().to(DEV))
        if kernel == "serial":
            outs.append(serial_verify(*args, torch.full((B,), T, device=DEV), K**-0.5, out=nan_out(B, T, HV, V)))
        else:
            outs.append(tree_verify(*args, inclusive_ancestor_mask(parents).to(DEV), K**-0.5, out=nan_out(B, T, HV, V)))
    ro, rd, rG, _ = naive_tree_gdn(q, k, v, g, beta, S0, parents, K**-0.5)
    for got, same, ref in zip(outs[0], outs[1], (ro, rd, rG)):
        assert not got.isnan().any() and torch.equal(got, same)
        assert torch.allclose(got.cpu(), ref.float(), rtol=1e-4, atol=1e-5)


def test_tree_verify_with_pending_commit_equals_serial_kernel(prepare, inverse):
    """The two kernels apply the same fused commit; then verify a 40-node random tree."""
    B, Tp, H, HV, K, V = 3, 5, 1, 2, 8, 4
    gen = torch.Generator().manual_seed(11)
    _, pk, pv, pg, pbeta, S0 = inputs(B, Tp, H, HV, K, V, gen)
    path = torch.tensor([[0, 1, 2], [0, -1, -1], [-1, -1, -1]])
    plen = torch.tensor([3, 1, 0])
    pdelta, pG = torch.randn(B, Tp, HV, V, generator=gen), -torch.rand(B, Tp, HV, generator=gen)
    pending = layer_commit(pk, pdelta, pG, path, plen)
    rng = random.Random(3)
    T = 40
    parents = torch.tensor([tree_parents("random", T, rng) for _ in range(B)])
    q, k, v, g, beta, _ = inputs(B, T, H, HV, K, V, gen)
    s_tree, s_serial = S0.clone().to(DEV), S0.clone().to(DEV)
    args = [x.to(DEV) for x in (q, k, v, g, beta)]
    o, d, G = tree_verify(*args, s_tree, inclusive_ancestor_mask(parents).to(DEV), K**-0.5, pending=pending,
                          out=nan_out(B, T, HV, V))
    serial_verify(*args, s_serial, torch.zeros(B, dtype=torch.int64, device=DEV), K**-0.5, pending=pending)
    assert torch.allclose(s_tree, s_serial, rtol=1e-6, atol=1e-6)
    assert torch.equal(s_tree[2].cpu(), S0[2])  # nothing pending for sequence 2: bit-identical
    ro, rd, rG, _ = naive_tree_gdn(q, k, v, g, beta, s_tree.cpu().double(), parents, K**-0.5)
    assert torch.allclose(o.cpu(), ro.float(), rtol=1e-4, atol=1e-5)
    assert torch.allclose(d.cpu(), rd.float(), rtol=1e-4, atol=1e-5)


def test_tree_verify_rejects_bad_input():
    gen = torch.Generator().manual_seed(0)
    q, k, v, g, beta, S0 = (x.to(DEV) for x in inputs(1, 3, 1, 1, 4, 4, gen))
    with pytest.raises(ValueError, match="mask must be bool"):
        tree_verify(q, k, v, g, beta, S0, torch.ones(1, 3, 3, device=DEV), 0.5)
    big = [torch.zeros(1, 65, 1, 4, device=DEV)] * 2
    with pytest.raises(ValueError, match='TUNING\\["tree"\\]\\["inverse"\\] must be one of \'auto\', \'serial\', \'blocked\', \'levels\', got \'row\'$'):
        with pytest.MonkeyPatch.context() as mp:
            mp.setitem(gdn_verify.TUNING, "tree", {**gdn_verify.TUNING["tree"], "inverse": "row"})
            tree_verify(q, k, v, g, beta, S0, torch.ones(1, 3, 3, dtype=torch.bool, device=DEV), 0.5)
    with pytest.raises(ValueError, match="at most 64 nodes"):
        tree_verify(*big, torch.zeros(1, 65, 1, 4, device=DEV), torch.zeros(1, 65, 1, device=DEV),
                    torch.zeros(1, 65, 1, device=DEV), S0, torch.ones(1, 65, 65, dtype=torch.bool, device=DEV), 0.5)


import specla  # noqa: E402
from conftest import make_model  # noqa: E402
from specla.testing import OracleDrafter  # noqa: E402
from specla import SpecConfig  # noqa: E402
from specla_fla.oracle import naive_greedy_decode  # noqa: E402


@pytest.mark.parametrize(
    "name, verify_kernel, pattern",
    [("base", "auto", "alternating"), ("base", "auto", "tree"), ("base", "auto", "zero_after_many"),
     ("gva", "auto", "tree"), ("base", "hybrid", "tree"), ("gva", "serial", "tree"), ("base", "parallel", "alternating"),
     ("odd_nogate", "auto", "tree")],
)
def test_engine_with_triton_kernels_is_exact(name, verify_kernel, pattern, monkeypatch):
    """The whole engine with kernels="triton" (fused delayed commit inside the verify kernel) is
    token-identical to sequential decoding, and its states match the reference path's."""
    import specla.mixers.gdn.verify as adapter_mod  # the mixer looks its verify kernels up there at each call

    calls = {"fused": 0, "plain": 0, "serial": 0, "parallel": 0, "hybrid": 0}

    def counting(fn, name):
        def wrapped(*args, pending=None, **kw):
            calls[name] += 1
            calls["fused" if pending is not None else "plain"] += 1
            return fn(*args, pending=pending, **kw)
        return wrapped

    for fn, kind in ((serial_verify, "serial"), (tree_verify, "parallel"), (hybrid_verify, "hybrid")):
        monkeypatch.setattr(adapter_mod, fn.__name__, counting(fn, kind))
    model = make_model(name, dtype=torch.float32, seed=6)
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (1, 7, 12)]
    refs = [naive_greedy_decode(model, p, 20) for p in prompts]
    states = {}
    for kernels in ("triton", "reference"):
        cfg = SpecConfig(num_draft_tokens=6, max_depth=6, max_new_tokens=14, device=DEV,  # graphs pick their own kernel
                         engine=dict(kernels=kernels, verify_kernel=verify_kernel, cuda_graphs="off"))
        dec = specla.SpecDecoder(model, "gdn", drafter=OracleDrafter(prompts, refs, pattern, V), config=cfg)
        result = dec.generate(prompts)
        assert result.outputs == [r[:14] for r in refs]
        states[kernels] = [s.cpu() for s in dec.adapter.recurrent_states()]
    for a, b in zip(states["triton"], states["reference"]):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)
    assert calls["fused"] > 0 and calls["plain"] > 0  # the kernels ran, with and without pending commits
    if verify_kernel != "auto":
        assert calls[verify_kernel] > 0
    if verify_kernel == "serial" and pattern == "tree":
        assert calls["hybrid"] > 0  # forced serial falls back to hybrid on real trees


from specla.mixers.gdn.commit import flush_commit  # noqa: E402
from specla.mixers.gdn.reference import gdn_commit_factor  # noqa: E402


def test_flush_kernel_equals_closed_form_and_skips_empty_paths():
    B, Tp, H, HV, K, V = 3, 6, 2, 4, 8, 20
    gen = torch.Generator().manual_seed(2)
    k = F.normalize(torch.randn(B, Tp, H, K, generator=gen), dim=-1)
    delta = torch.randn(B, Tp, HV, V, generator=gen)
    G = -torch.rand(B, Tp, HV, generator=gen).cumsum(1)
    S0 = torch.randn(B, HV, K, V, generator=gen)
    path = torch.tensor([[0, 2, 5], [1, -1, -1], [-1, -1, -1]])
    plen = torch.tensor([3, 1, 0])
    state = S0.clone().to(DEV)
    assert flush_commit(state, layer_commit(k, delta, G, path, plen)) is state
    ref = gdn_commit_factor(S0, k, delta, G, path, plen)
    assert torch.allclose(state.cpu(), ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(state[2].cpu(), S0[2])
    with pytest.raises(ValueError, match="pending must be"):
        flush_commit(state, layer_commit(k, delta.double(), G, path, plen))




@pytest.mark.parametrize("kind", SHAPES)
@pytest.mark.parametrize("with_pending", [False, True])
def test_hybrid_verify_equals_naive(kind, with_pending):
    """Root-explicit trees (one root chain per sequence, so the fused commit runs once)."""
    B, H, HV, K, V = 2, 1, 2, 8, 12
    rng = random.Random(len(kind) * 3 + with_pending)
    sizes = [1, 1] if kind == "single" else [12, 6]
    T = max(sizes) + 1
    rows = []
    for n in sizes:  # node 0 is the root; padding hangs from the root
        body = tree_parents(kind, n, rng) if kind != "single" else [-1]
        rows.append([-1] + [p + 1 for p in body] + [0] * (T - 1 - len(body)))
    parents = torch.tensor(rows)
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    q, k, v, g, beta, S0 = inputs(B, T, H, HV, K, V, gen)
    pending, committed = None, S0
    if with_pending:
        pk = F.normalize(torch.randn(B, 3, H, K, generator=gen), dim=-1)
        pdelta, pG = torch.randn(B, 3, HV, V, generator=gen), -torch.rand(B, 3, HV, generator=gen).cumsum(1)
        path, plen = torch.tensor([[0, 1, 2], [0, -1, -1]]), torch.tensor([3, 1])
        pending = layer_commit(pk, pdelta, pG, path, plen)
        committed = gdn_commit_factor(S0, pk, pdelta, pG, path, plen)
    state = S0.clone().to(DEV)
    o, d, G = hybrid_verify(*(x.to(DEV) for x in (q, k, v, g, beta)), state, parents.to(DEV), K**-0.5,
                            pending=pending, out=nan_out(B, T, HV, V))
    ro, rd, rG, _ = naive_tree_gdn(q, k, v, g, beta, committed.double(), parents, K**-0.5)
    for got, ref in ((o, ro), (d, rd), (G, rG)):
        assert not got.isnan().any()
        assert torch.allclose(got.cpu(), ref.float(), rtol=1e-4, atol=1e-5)
    assert torch.allclose(state.cpu(), committed, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(DEV != "cuda", reason="the GDN-1.3B layer shape needs a GPU")
@pytest.mark.parametrize("qk", ["bfloat16", "float32"])
@pytest.mark.parametrize("kernel", ["serial", "parallel", "hybrid"])
def test_kernels_at_gdn13b_layer_shape_bf16(kernel, qk):
    """H=8, K=V=256, bf16 v, q/k in bf16 or, as the GDN mixer passes them, L2-normalised in
    float32 (multiplied in ``TUNING["tree"]["dot"]`` on a GPU, as bf16 inputs are); gates
    and beta float32, ragged pending commits (0..3 accepted): outputs within 1e-2 of the float64
    naive reference on the same rounded inputs, factor records and the committed state within 1e-3
    (DESIGN.md section 7.1)."""
    B, H, HV, K, V, Tp = 4, 8, 8, 256, 256, 4
    rng = random.Random(13)
    T = 8 if kernel == "serial" else 32
    if kernel == "serial":
        parents = chain(B, T)
    else:  # root-explicit random trees: node 0 is the root
        parents = torch.tensor([[-1] + [rng.randrange(0, i) for i in range(1, T)] for _ in range(B)])
    gen = torch.Generator().manual_seed(29)
    q, k, v, g, beta, S0 = inputs(B, T, H, HV, K, V, gen)
    v = v.bfloat16().float()  # the reference sees the rounded inputs
    if qk == "bfloat16":
        q, k = q.bfloat16().float(), k.bfloat16().float()
    pk = F.normalize(torch.randn(B, Tp, H, K, generator=gen), dim=-1).bfloat16()
    pdelta = torch.randn(B, Tp, HV, V, generator=gen)
    pG = -(torch.rand(B, Tp, HV, generator=gen) * 0.5).cumsum(1)
    path, plen = ragged_pending()
    committed = gdn_commit_factor(f64(S0), f64(pk), f64(pdelta), f64(pG), path.to(DEV), plen.to(DEV))
    pending = layer_commit(pk, pdelta, pG, path, plen)
    state = S0.clone().to(DEV)
    args = [x.to(DEV) for x in (q.to(getattr(torch, qk)), k.to(getattr(torch, qk)), v.bfloat16(), g, beta)]
    out = (torch.full((B, T, HV, V), float("nan"), device=DEV, dtype=torch.bfloat16),) + nan_out(B, T, HV, V)[1:]
    if kernel == "serial":
        o, d, G = serial_verify(*args, state, torch.full((B,), T, device=DEV), K**-0.5, pending=pending, out=out)
    elif kernel == "parallel":
        o, d, G = tree_verify(*args, state, inclusive_ancestor_mask(parents).to(DEV), K**-0.5, pending=pending,
                              out=out)
    else:
        o, d, G = hybrid_verify(*args, state, parents.to(DEV), K**-0.5, pending=pending, out=out)
    ro, rd, rG, _ = naive_tree_gdn(f64(q), f64(k), f64(v), f64(g), f64(beta), committed,
                                   parents, K**-0.5)


    assert not any(x.isnan().any() for x in (o, d, G))
    assert o.dtype == torch.bfloat16 and state.dtype == torch.float32
    assert rel_err(o.double(), ro) < 1e-2
    assert rel_err(d.double(), rd) < 1e-3 and rel_err(G.double(), rG) < 1e-5
    assert rel_err(state.double(), committed) < 1e-5
    assert torch.equal(state[2].cpu(), S0[2])  # nothing pending for sequence 2: bit-identical


def test_tree_verify_visits_the_state_in_k_blocks(monkeypatch, prepare):
    """K = 40 in blocks of 16 (the last one partial) and V = 20 in two tiles, with a ragged pending
    commit: the same outputs, records and committed state as the naive reference."""
    from specla.mixers.gdn import verify as vk

    monkeypatch.setitem(vk.TUNING, "tree", {**vk.TUNING["tree"], "tiles": {"separate": (16, 16), "fused": (16, 16)},
                                            "num_warps": 4})
    B, Tp, H, HV, K, V = 2, 4, 1, 2, 40, 20
    gen = torch.Generator().manual_seed(17)
    rng = random.Random(17)
    T = 11
    parents = torch.tensor([[-1] + [rng.randrange(0, i) for i in range(1, T)] for _ in range(B)])
    q, k, v, g, beta, S0 = inputs(B, T, H, HV, K, V, gen)
    pk = F.normalize(torch.randn(B, Tp, H, K, generator=gen), dim=-1)
    pdelta, pG = torch.randn(B, Tp, HV, V, generator=gen), -torch.rand(B, Tp, HV, generator=gen).cumsum(1)
    path, plen = torch.tensor([[0, 1, 2], [-1, -1, -1]]), torch.tensor([3, 0])
    committed = gdn_commit_factor(S0, pk, pdelta, pG, path, plen)
    state = S0.clone().to(DEV)
    o, d, G = tree_verify(*(x.to(DEV) for x in (q, k, v, g, beta)), state, inclusive_ancestor_mask(parents).to(DEV),
                          K**-0.5, pending=layer_commit(pk, pdelta, pG, path, plen),
                          out=nan_out(B, T, HV, V))
    ro, rd, rG, _ = naive_tree_gdn(q, k, v, g, beta, committed.double(), parents, K**-0.5)
    for got, ref in ((o, ro), (d, rd), (G, rG)):
        assert not got.isnan().any()
        assert torch.allclose(got.cpu(), ref.float(), rtol=1e-4, atol=1e-5)
    assert torch.allclose(state.cpu(), committed, rtol=1e-5, atol=1e-5)
    assert torch.equal(state[1].cpu(), S0[1])


def test_tree_verify_with_a_pending_path_of_width_zero_commits_nothing(prepare):
    """A pending commit whose path is ``[B, 0]`` (accepted by ``check_layer_commit``): the same
    outputs as without a pending commit, and the state bit-identical (it once read past the
    path and crashed)."""
    B, Tp, H, HV, K, V, T = 2, 3, 1, 2, 20, 12, 5
    gen = torch.Generator().manual_seed(23)
    q, k, v, g, beta, S0 = inputs(B, T, H, HV, K, V, gen)
    mask = inclusive_ancestor_mask(chain(B, T)).to(DEV)
    pk = F.normalize(torch.randn(B, Tp, H, K, generator=gen), dim=-1)
    pdelta, pG = torch.randn(B, Tp, HV, V, generator=gen), -torch.rand(B, Tp, HV, generator=gen).cumsum(1)
    pending = layer_commit(pk, pdelta, pG, torch.empty(B, 0, dtype=torch.int64), torch.zeros(B, dtype=torch.int64))
    args = [x.to(DEV) for x in (q, k, v, g, beta)]
    state, plain = S0.clone().to(DEV), S0.clone().to(DEV)
    got = tree_verify(*args, state, mask, K**-0.5, pending=pending, out=nan_out(B, T, HV, V))
    ref = tree_verify(*args, plain, mask, K**-0.5, out=nan_out(B, T, HV, V))
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    assert torch.equal(state.cpu(), S0)


@pytest.mark.parametrize("plugin", ["gdn", "gla", "mamba2"])
def test_kernels_auto_means_triton_on_cuda_only(plugin, monkeypatch):
    """``SpecConfig.engine.kernels`` defaults to ``auto``: the Triton kernels on a CUDA device, the
    reference path elsewhere; ``triton`` and ``reference`` force either."""
    from specla import SpecConfig
    from specla.registry import get_plugin

    p = get_plugin(plugin)
    model = p.tiny_model(next(iter(p.tiny_variants)))
    # no kernel runs below: @triton.jit picks compiled or interpreted kernels when they are
    # defined (where first used), so running one under the variable would interpret it for the
    # rest of a GPU test process
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # kernels="triton" on the CPU needs it
    assert SpecConfig().engine.kernels == "auto"
    from specla import ConfigError
    from specla.ops import compiled_kernels_loaded

    for kernels, on_cpu in (("auto", False), ("triton", True), ("reference", False)):
        cfg = SpecConfig(engine={"kernels": kernels}, device="cpu", dtype="float32")
        if kernels == "triton" and compiled_kernels_loaded():  # a GPU run: the kernels are compiled
            with pytest.raises(ConfigError, match=r"was set after Triton kernels \(specla's or FLA's\) were loaded"):
                p.make_adapter(model, cfg)
            continue
        adapter = p.make_adapter(model, cfg)
        assert adapter.triton_kernels is on_cpu
    if torch.cuda.is_available():
        assert p.make_adapter(model, SpecConfig(device="cuda", dtype="float32")).triton_kernels is True


def test_triton_kernels_on_cpu_without_the_interpreter_are_rejected_clearly(monkeypatch):
    from specla import ConfigError, SpecConfig
    from specla.registry import get_plugin

    p = get_plugin("gdn")
    model = p.tiny_model("base")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="needs TRITON_INTERPRET=1"):
        p.make_adapter(model, SpecConfig(engine={"kernels": "triton"}, device="cpu"))
    p.make_adapter(model, SpecConfig(engine={"kernels": "auto"}, device="cpu"))  # auto falls back to the reference path


def test_triton_kernels_without_triton_installed_are_rejected_clearly(monkeypatch):
    """Before anything imports Triton (the README's CPU install has none), and whatever
    ``TRITON_INTERPRET`` says."""
    import importlib.util

    from specla import ConfigError, SpecConfig
    from specla.registry import get_plugin

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else find_spec(name, *a))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    p = get_plugin("qwen")
    model = p.tiny_model(p.tiny_variants[0])
    with pytest.raises(ConfigError, match=r"^kernels='triton' needs Triton, which is not installed \(pip install "
                                          r"triton; CUDA builds of torch bring it\); use kernels='auto' or "
                                          r"'reference'$"):
        p.make_adapter(model, SpecConfig(engine={"kernels": "triton"}, device="cpu"))
    p.make_adapter(model, SpecConfig(engine={"kernels": "auto"}, device="cpu"))


def test_recorded_one_token_steps_use_the_serial_kernel(monkeypatch):
    """Plain decoding (no budget) with ``cuda_graphs="on"`` (unrecorded on the CPU) and the Triton
    kernels: the fixed-shape one-token verify runs the serial kernel (the parallel one is for
    trees) and the output equals sequential decoding."""
    import specla.mixers.gdn.verify as adapter_mod  # the mixer looks its verify kernels up there at each call

    calls = []  # (kernel, nodes per row) of every verify call
    for fn, kind in ((serial_verify, "serial"), (tree_verify, "parallel")):
        monkeypatch.setattr(adapter_mod, fn.__name__,
                            (lambda f, k: lambda *a, **kw: calls.append((k, a[0].shape[1])) or f(*a, **kw))(fn, kind))
    model = make_model("base", dtype=torch.float32, seed=6)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (3, 9)]
    cfg = SpecConfig(num_draft_tokens=0, max_new_tokens=6, device=DEV,
                     engine=dict(kernels="triton", cuda_graphs="on" if DEV == "cuda" else "unrecorded"))
    out = specla.SpecDecoder(model, "gdn", drafter="ngram", config=cfg).generate(prompts).outputs
    assert out == [naive_greedy_decode(model, p, 6) for p in prompts]
    # the decoding steps' calls (prefill chunks are longer); a recorded graph calls Python only
    # while it is recorded, so on CUDA these are the warm-up and the capture
    one = [kind for kind, T in calls if T == 1]
    assert len(one) >= 2 * 2 and set(one) == {"serial"}


def test_interpreter_set_after_the_kernels_loaded_is_refused_clearly():
    """``TRITON_INTERPRET=1`` set in a process whose Triton kernels were already defined compiled
    (specla's, a kernel module imported first; or FLA's, which loading an FLA model imports) cannot
    take effect: ``kernels="triton"`` on the CPU raises a ``ConfigError`` saying so, not Triton's
    "0 active drivers" at the first launch. Run in fresh processes without the variable (this one
    has it fixed by conftest.py)."""
    import os
    import subprocess
    import sys

    def run(first: str) -> str:
        code = (
            "import os\n"
            "from specla import SpecDecoder, ConfigError\n"
            "from specla_fla.plugin import TINY_TARGET as tiny\n"
            f"{first}\n"
            "os.environ['TRITON_INTERPRET'] = '1'\n"
            "try:\n"
            "    cfg = dict(max_new_tokens=2, device='cpu', engine={'kernels': 'triton'})\n"
            "    SpecDecoder(tiny, config=cfg).generate([[5, 6]])\n"
            "    print('interpreted')\n"
            "except ConfigError as err:\n"
            "    print('ConfigError:', err)\n"
        )
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["CUDA_VISIBLE_DEVICES"] = ""
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        return out.stdout + out.stderr

    for first in ("SpecDecoder(tiny, config=dict(max_new_tokens=2, device='cpu'))", "import specla.ops.conv_triton"):
        out = run(first)
        assert "ConfigError: kernels='triton' on cpu: TRITON_INTERPRET=1 was set after Triton kernels (specla's or " \
               "FLA's) were loaded as compiled kernels" in out, out


@pytest.mark.parametrize("name", ["gva", "odd_nogate"])
def test_chunked_prefill_equals_chain_prefill(name, monkeypatch):
    """``prefill="chunked"`` (whole prompts through FLA's chunked gated delta rule, padding rows
    with ``g = beta = 0``) leaves the states, conv windows and prompt features that the 64-token
    chain passes leave, for ragged prompts on both sides of FLA's and the chain's 64-token chunks,
    and decoding after it is token-identical to sequential decoding; on the reference path the
    option falls back to the chain passes."""
    from fla_oracle import whole_prompt_prefill_calls

    calls = whole_prompt_prefill_calls(monkeypatch)
    model = make_model(name, dtype=torch.float32, seed=3)
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (1, 70, 9)]
    refs = [naive_greedy_decode(model, p, 8) for p in prompts]
    seen = {}
    for prefill, kernels in (("chain", "triton"), ("chunked", "triton"), ("chunked", "reference")):
        cfg = SpecConfig(num_draft_tokens=4, max_depth=4, max_new_tokens=8, device=DEV,
                         engine=dict(kernels=kernels, cuda_graphs="off", prefill=prefill))
        dec = specla.SpecDecoder(model, "gdn", drafter="ngram", config=cfg)
        calls.clear()
        dec.adapter.prefill(prompts)
        assert len(calls) == (model.config.num_hidden_layers if (prefill, kernels) == ("chunked", "triton") else 0)
        assert dec.adapter.prefill_form == ("chunked" if (prefill, kernels) == ("chunked", "triton") else "chain")
        ad = dec.adapter
        seen[prefill, kernels] = ([t.clone() for t in ad._state_list()], ad.last_hidden.clone(),
                                  [ad.prompt_hidden[i, : len(p) - 1].clone() for i, p in enumerate(prompts)])
        if (prefill, kernels) != ("chunked", "triton"):
            continue
        out = dec.generate(prompts).outputs
        if DEV == "cpu":
            assert out == refs
        else:  # FLA's chunk kernels multiply float32 in TF32 on a GPU: near-ties may differ from the
            # sequential float32 decode, never between speculative and plain decoding
            plain = specla.SpecDecoder(model, "gdn", config=cfg.model_copy(update={"num_draft_tokens": 0}))
            assert out == plain.generate(prompts).outputs
    # TF32 on a GPU; the features pass the states' differences through the later layers
    tol = dict(rtol=1e-4, atol=1e-5) if DEV == "cpu" else dict(rtol=1e-2, atol=2e-3)
    ftol = tol if DEV == "cpu" else dict(rtol=1e-2, atol=1e-2)
    for other in (("chunked", "triton"), ("chunked", "reference")):
        (s1, h1, f1), (s2, h2, f2) = seen["chain", "triton"], seen[other]
        for a, b in zip(s1, s2):  # recurrent states and conv windows
            torch.testing.assert_close(a, b, **tol)
        torch.testing.assert_close(h1, h2, **ftol)
        for a, b in zip(f1, f2):
            torch.testing.assert_close(a, b, **ftol)


@pytest.mark.parametrize("graphs", ["auto", "unrecorded"])
def test_prefill_passes_equal_chain_prefill(graphs, monkeypatch):
    """``prefill="passes"``: prompts in fixed-width passes through FLA's chunked gated delta rule,
    each from the state and conv window the previous pass left (the pass width set to 32 here,
    so ragged prompts of 1, 45 and 9 tokens take two passes, the short rows padding through the
    second), recorded in a CUDA graph where one is available: the states, conv windows and
    prompt features of the 64-token chain passes, and decoding after it equals plain decoding
    with the same prefill (and, on the CPU, sequential float32 decoding)."""
    import specla.model.prefill as prefill_sizes
    from fla_oracle import whole_prompt_prefill_calls

    calls = whole_prompt_prefill_calls(monkeypatch)
    monkeypatch.setattr(prefill_sizes, "PREFILL_PASS", 32)
    model = make_model("gva", dtype=torch.float32, seed=5)
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (1, 45, 9)]
    seen = {}
    for prefill in ("chain", "passes"):
        cfg = SpecConfig(num_draft_tokens=4, max_depth=4, max_new_tokens=8, device=DEV,
                         engine=dict(kernels="triton", cuda_graphs=graphs, prefill=prefill, budget_policy="fixed"))
        dec = specla.SpecDecoder(model, "gdn", drafter="ngram", config=cfg)
        ad = dec.adapter
        for _ in range(2):  # the second prefill replays the recorded pass (and starts from a used state)
            calls.clear()
            ad.prefill(prompts)
        recorded = graphs == "auto" and DEV == "cuda"
        # recorded: the kernels run at the recording only; unrecorded: two passes of every layer
        assert len(calls) == (0 if prefill == "chain" or recorded else 2 * model.config.num_hidden_layers)
        seen[prefill] = ([t.clone() for t in ad._state_list()], ad.last_hidden.clone(),
                         [ad.prompt_hidden[i, : len(p) - 1].clone() for i, p in enumerate(prompts)])
        assert ad.prefill_form == prefill
        if prefill == "passes":
            run = dec.generate(prompts)
            out = run.outputs
            plain = specla.SpecDecoder(model, "gdn", config=cfg.model_copy(update={"num_draft_tokens": 0}))
            assert run.stats.prefill == "passes" and out == plain.generate(prompts).outputs
            if DEV == "cpu":
                assert out == [naive_greedy_decode(model, p, 8) for p in prompts]
    tol = dict(rtol=1e-4, atol=1e-5) if DEV == "cpu" else dict(rtol=1e-2, atol=2e-3)  # TF32 on a GPU
    ftol = tol if DEV == "cpu" else dict(rtol=1e-2, atol=1e-2)
    (s1, h1, f1), (s2, h2, f2) = seen["chain"], seen["passes"]
    for a, b in zip(s1, s2):
        assert not a.isnan().any()
        torch.testing.assert_close(a, b, **tol)
    torch.testing.assert_close(h1, h2, **ftol)
    for a, b in zip(f1, f2):
        torch.testing.assert_close(a, b, **ftol)


def test_default_prefill_takes_the_passes_in_half_precision(monkeypatch):
    """``prefill="auto"`` (the default) runs the passes where they run, the activations are
    bfloat16 or float16 and every mixer opts in (``Mixer.prefill_by_default``: GDN does), and the
    chain passes otherwise, in float32 too (FLA's chunked kernels multiply float32
    in TF32; a float32 run stays exact). On a GPU a bfloat16 model's prefill runs them (recorded:
    FLA's kernels run at the recording only) and decoding after it equals plain decoding."""
    from fla_oracle import whole_prompt_prefill_calls

    calls = whole_prompt_prefill_calls(monkeypatch)
    prompts = [[5, 9, 2, 7, 1, 3, 8], [4, 6]]
    cfg = SpecConfig(num_draft_tokens=4, max_depth=4, max_new_tokens=6, device=DEV,
                     engine={"kernels": "triton", "budget_policy": "fixed"})
    assert cfg.engine.prefill == "auto"
    ad = specla.SpecDecoder(make_model("gva", dtype=torch.float32, seed=5), "gdn", config=cfg).adapter
    ad.prefill(prompts)
    assert ad.prefill_form == "chain" and not calls
    if DEV == "cpu":  # runs are float32 on a CPU: the rule alone, on the adapter's activation dtype
        from specla.mixers.gdn.mixer import GDNMixer

        for dtype, form in ((torch.bfloat16, True), (torch.float16, True), (torch.float64, False)):
            monkeypatch.setattr(ad, "dtype", dtype)
            assert ad._chunk_passes() is form
        monkeypatch.setattr(GDNMixer, "prefill_by_default", False)  # a plugin that has not opted in
        assert ad._chunk_passes() is False
        monkeypatch.setattr(GDNMixer, "prefill_by_default", True)
        monkeypatch.setattr(ad, "dtype", torch.bfloat16)  # where auto takes the passes (above)
        monkeypatch.setattr(ad, "config", cfg.with_engine(prefill="chain"))
        assert ad._chunk_passes() is False
        return
    model = make_model("gva", dtype=torch.bfloat16, seed=5)
    cfg = cfg.model_copy(update={"dtype": "bfloat16"})
    dec = specla.SpecDecoder(model, "gdn", drafter="ngram", config=cfg)
    run = dec.generate(prompts)
    assert run.stats.prefill == "passes" and calls
    plain = specla.SpecDecoder(model, "gdn", config=cfg.model_copy(update={"num_draft_tokens": 0}))
    assert run.outputs == plain.generate(prompts).outputs


def test_prefill_passes_fall_back_to_chain_passes_where_their_kernels_cannot_run():
    """On the reference path (no Triton kernels, so no FLA chunk kernels) ``prefill="passes"``
    and the default ``"auto"`` run the 64-token chain passes, and the run's stats say which ran: the same tokens as
    ``prefill="chain"``."""
    model = make_model("gva", dtype=torch.float32, seed=5)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [7, 3]]
    outs = {}
    for prefill in ("passes", "chain", "auto"):
        cfg = SpecConfig(num_draft_tokens=3, max_depth=3, max_new_tokens=4, device="cpu",
                         engine=dict(kernels="reference", cuda_graphs="off", prefill=prefill))
        run = specla.SpecDecoder(model, "gdn", drafter="ngram", config=cfg).generate(prompts)
        assert run.stats.prefill == "chain" and run.stats.to_dict()["prefill"] == "chain"
        outs[prefill] = run.outputs
    assert outs["passes"] == outs["chain"] == outs["auto"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the whole-prompt pass runs FLA's kernels on a GPU only")
def test_chunked_prefill_in_bfloat16_decodes_like_plain_decoding(monkeypatch):
    """``prefill="chunked"`` on a bfloat16 model (FLA's kernels take k, v and beta in one dtype):
    the whole-prompt pass runs in every layer, speculative decoding after it equals plain decoding
    with the same prefill, and the states stay within bfloat16 rounding of the chain passes'."""
    from fla_oracle import whole_prompt_prefill_calls

    calls = whole_prompt_prefill_calls(monkeypatch)
    model = make_model("gva", dtype=torch.bfloat16, seed=3)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (1, 70, 9)]
    states = {}
    for prefill in ("chunked", "chain"):
        cfg = SpecConfig(num_draft_tokens=4, max_depth=4, max_new_tokens=8, device=DEV, dtype="bfloat16",
                         engine=dict(prefill=prefill))
        ad = specla.SpecDecoder(model, "gdn", config=cfg).adapter
        calls.clear()
        ad.prefill(prompts)
        assert len(calls) == (model.config.num_hidden_layers if prefill == "chunked" else 0)
        states[prefill] = [t.float().clone() for t in ad.recurrent_states()]
    for a, b in zip(states["chunked"], states["chain"]):
        torch.testing.assert_close(a, b, rtol=5e-2, atol=2e-2)
    cfg = SpecConfig(num_draft_tokens=4, max_depth=4, max_new_tokens=8, device=DEV, dtype="bfloat16",
                     engine=dict(prefill="chunked", budget_policy="fixed"))
    out = specla.SpecDecoder(model, "gdn", drafter="ngram", config=cfg).generate(prompts).outputs
    plain = specla.SpecDecoder(model, "gdn", config=cfg.model_copy(update={"num_draft_tokens": 0}))
    assert out == plain.generate(prompts).outputs
