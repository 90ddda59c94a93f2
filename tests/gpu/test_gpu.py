"""GPU cases (skipped without CUDA): the reference path on CUDA and the kernels at GPU scale. A plain
``python -m pytest`` on a CUDA machine runs them compiled (tests/conftest.py); FLA's compiled
kernels as the oracle: tests/plugins/test_fla_oracle.py, which runs on the GPU there."""

import pytest
import torch

import specla
from specla_fla.oracle import naive_greedy_decode
from conftest import make_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(autouse=True)
def exact_fp32_matmul():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.parametrize("name", ["base", "gva", "odd_nogate"])
@pytest.mark.parametrize("commit", ["factor", "snapshot", "replay", "triton-serial", "triton-parallel",
                                    "triton-hybrid", "default"])
def test_cuda_token_identical(name, commit):
    """Reference path (each commit strategy), the compiled Triton kernels (factor commit, each
    verify kernel) and the default config (Triton kernels on CUDA, ``auto`` dispatch) against the
    naive sequential decoder."""
    model = make_model(name, dtype=torch.float32, seed=2)  # stays on the CPU for the naive oracle
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(3)
    motif = torch.randint(0, V, (6,), generator=g).tolist()
    prompts = [motif * 3, torch.randint(0, V, (9,), generator=g).tolist(), [motif[0]]]
    cfg = dict(device="cuda", max_new_tokens=24, top_k=2, engine=dict(commit=commit, kernels="reference"))
    if commit == "default":
        cfg = dict(device="cuda", max_new_tokens=24, top_k=2)
    elif commit.startswith("triton-"):
        cfg["engine"] = dict(commit="factor", kernels="triton", verify_kernel=commit.split("-")[1])
        if cfg["engine"]["verify_kernel"] == "serial":
            cfg["top_k"] = 1  # chains
    result = specla.run(model, "gdn", prompts=prompts, config=cfg)
    assert result.outputs == [naive_greedy_decode(model, p, 24) for p in prompts]


def test_cuda_demo_and_eagle_drafter_are_exact():
    from specla.apps.demo import run_demo

    for drafter in ("ngram", "eagle"):
        summary = run_demo(device="cuda", max_new_tokens=48, drafter=drafter, echo=lambda *_: None)
        assert summary["exact_match"] is True and summary["device"] == "cuda"
        print(drafter, summary)  # the GPU run's figures, for the closing note


# ---------------------------------------------------------------- more programs than one grid axis
# CUDA caps grid axes 1 and 2 at 65535; every kernel puts its (sequence, head) index on axis 0
# (limit 2^31 - 1). Each launch with B * heads > 65535 must equal the same kernel run on batch
# slices small enough for any axis (sequences are independent, so the slices are an exact oracle).

def _rand(gen, *shape, low=None):
    x = torch.randn(*shape, generator=gen, device="cuda")
    return x if low is None else -(torch.rand(*shape, generator=gen, device="cuda") * low)


def _paths(B, Tp, gen):
    """Chain-shaped pending paths with ragged lengths 0..Tp."""
    plen = torch.randint(0, Tp + 1, (B,), generator=gen, device="cuda")
    idx = torch.arange(Tp, device="cuda").expand(B, Tp)
    return torch.where(idx < plen[:, None], idx, -1).contiguous(), plen


def _tree(B, T, gen):
    """Random root-explicit trees (node 0 the root)."""
    r = torch.rand(B, T, generator=gen, device="cuda")
    parents = (r * torch.arange(T, device="cuda")).long()
    parents[:, 0] = -1
    return parents.contiguous()


def _sliced(fn, args, B, chunk=16384):
    """``fn`` on batch slices of ``args`` (tensors whose first dim is ``B`` are sliced; in-place
    state updates land in the slices' storage)."""
    outs = []
    for lo in range(0, B, chunk):
        outs.append(fn(*[a[lo : lo + chunk] if isinstance(a, torch.Tensor) and a.dim() and a.shape[0] == B
                         else a for a in args]))
    return outs


def _assert_same(full_state, sliced_state, full_out, sliced_outs):
    assert torch.equal(full_state, sliced_state)
    for i, got in enumerate(full_out if isinstance(full_out, tuple) else (full_out,)):
        ref = torch.cat([o[i] if isinstance(o, tuple) else o for o in sliced_outs])
        assert not got.isnan().any()
        assert torch.equal(got, ref)


@pytest.mark.parametrize("kernel", ["serial", "parallel", "hybrid", "flush"])
def test_gdn_kernels_beyond_65535_programs(kernel):
    from specla.records import LayerCommit
    from specla.tree import inclusive_ancestor_mask
    from specla.mixers.gdn.commit import flush_commit
    from specla.mixers.gdn.records import GDNFactorRecord
    from specla.mixers.gdn.verify import hybrid_verify, serial_verify, tree_verify

    B, T, Tp, H, HV, K, V = 32800, 4, 3, 1, 2, 16, 16  # B * HV = 65600 programs per V tile
    gen = torch.Generator("cuda").manual_seed(7)
    q, k = (torch.nn.functional.normalize(_rand(gen, B, T, H, K), dim=-1) for _ in range(2))
    v, g, beta = _rand(gen, B, T, HV, V), _rand(gen, B, T, HV, low=0.5), torch.rand(B, T, HV, generator=gen, device="cuda")
    pk = torch.nn.functional.normalize(_rand(gen, B, Tp, H, K), dim=-1)
    pending = (pk, _rand(gen, B, Tp, HV, V), _rand(gen, B, Tp, HV, low=0.5).cumsum(1), *_paths(B, Tp, gen))
    S0 = _rand(gen, B, HV, K, V)
    parents = _tree(B, T, gen)

    def call(q, k, v, g, beta, state, parents, pk, pd, pG, path, plen):
        pending = LayerCommit(GDNFactorRecord(k=pk, delta=pd, G=pG, conv_x=None), path, plen)
        out = tuple(torch.full(s, float("nan"), device="cuda") for s in ((q.shape[0], T, HV, V),) * 2 + ((q.shape[0], T, HV),))
        if kernel == "flush":
            return flush_commit(state, pending).clone()
        if kernel == "serial":
            n = torch.full((q.shape[0],), T, device="cuda")
            return serial_verify(q, k, v, g, beta, state, n, K**-0.5, pending=pending, out=out)
        if kernel == "parallel":
            return tree_verify(q, k, v, g, beta, state, inclusive_ancestor_mask(parents), K**-0.5,
                               pending=pending, out=out)
        return hybrid_verify(q, k, v, g, beta, state, parents, K**-0.5, pending=pending, out=out)

    args = [q, k, v, g, beta, None, parents, *pending]
    full_state, sliced_state = S0.clone(), S0.clone()
    full = call(*args[:5], full_state, *args[6:])
    sliced = _sliced(call, args[:5] + [sliced_state] + args[6:], B)
    _assert_same(full_state, sliced_state, full, sliced)
    assert not torch.equal(full_state, S0)  # the pending commits were applied


@pytest.mark.parametrize("kernel", ["serial", "parallel", "flush"])
@pytest.mark.parametrize("plugin", ["gla", "mamba2"])
def test_gla_mamba2_kernels_beyond_65535_programs(plugin, kernel):
    from specla.records import LayerCommit
    from specla.tree import inclusive_ancestor_mask

    B, T, Tp, H = 32800, 4, 3, 2  # B * H = 65600 programs per value tile
    gen = torch.Generator("cuda").manual_seed(11)
    mask = inclusive_ancestor_mask(_tree(B, T, gen))
    if plugin == "gla":
        from specla.mixers.gla.commit import flush_commit
        from specla.mixers.gla.records import GLAFactorRecord as Record
        from specla.mixers.gla.verify import serial_verify, tree_verify

        K = V = 8
        inputs = [_rand(gen, B, T, H, K), _rand(gen, B, T, H, K), _rand(gen, B, T, H, V), _rand(gen, B, T, H, K, low=0.5)]
        pending = [_rand(gen, B, Tp, H, K), _rand(gen, B, Tp, H, V), _rand(gen, B, Tp, H, K, low=0.5).cumsum(1)]
        S0, extra = _rand(gen, B, H, K, V), [K**-0.5]
    else:
        from specla.mixers.mamba2.commit import flush_commit
        from specla.mixers.mamba2.records import Mamba2FactorRecord as Record
        from specla.mixers.mamba2.verify import serial_verify, tree_verify

        P, N = 8, 8
        dt = torch.rand(B, T, H, generator=gen, device="cuda")
        A = -torch.rand(H, generator=gen, device="cuda")
        D = torch.rand(H, generator=gen, device="cuda")
        inputs = [_rand(gen, B, T, H, P), dt, dt * A, _rand(gen, B, T, 1, N), _rand(gen, B, T, 1, N), D]
        pending = [_rand(gen, B, Tp, 1, N), _rand(gen, B, Tp, H, P), _rand(gen, B, Tp, H, low=0.5).cumsum(1)]
        S0, extra = _rand(gen, B, H, N, P), []
    pending += list(_paths(B, Tp, gen))
    n_in, n_pend = len(inputs), len(pending)

    def call(*a):
        ins, state, mask, pend = a[:n_in], a[n_in], a[n_in + 1], tuple(a[n_in + 2 :])
        commit = LayerCommit(Record(*pend[:3], conv_x=None), *pend[3:])  # the record's first three fields
        if kernel == "flush":
            return flush_commit(state, commit).clone()
        if kernel == "serial":
            n = torch.full((state.shape[0],), T, device="cuda")
            return serial_verify(*ins, state, n, *extra, pending=commit)
        return tree_verify(*ins, state, mask, *extra, pending=commit)

    full_state, sliced_state = S0.clone(), S0.clone()
    full = call(*inputs, full_state, mask, *pending)
    sliced = _sliced(call, [*inputs, sliced_state, mask, *pending], B)
    _assert_same(full_state, sliced_state, full, sliced)
    assert not torch.equal(full_state, S0)
    assert len(pending) == n_pend


def test_conv_kernels_beyond_65535_programs():
    from specla.ops.conv import conv_ancestors
    from specla.ops.conv_triton import conv_commit, tree_conv

    B, T, D, C = 16400, 4, 32, 4  # B * T = 65600 programs; conv_commit gets B * (C - 1) = 49200, so
    gen = torch.Generator("cuda").manual_seed(5)  # its case uses a wider window below
    x, window = _rand(gen, B, T, D), _rand(gen, B, C - 1, D)
    weight, bias = _rand(gen, D, C), _rand(gen, D)
    anc = conv_ancestors(_tree(B, T, gen), C)
    full = tree_conv(x, window, weight, bias, anc)
    _assert_same(window, window, full, _sliced(lambda x, w, a: tree_conv(x, w, weight, bias, a), [x, window, anc], B))
    Bw, W = 16400, 5  # B * W = 82000 programs
    xw, win = _rand(gen, Bw, T, D), _rand(gen, Bw, W, D)
    path, plen = _paths(Bw, T, gen)
    full = conv_commit(xw, win, path, plen)
    _assert_same(win, win, full, _sliced(conv_commit, [xw, win, path, plen], Bw))
