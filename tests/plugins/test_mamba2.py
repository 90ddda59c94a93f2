"""The Mamba2 plugin: reference ops against their sequential twins, the model-level verify and
commit against plain sequential decoding (NaiveMamba2), end-to-end token identity, one grouped
layer step of FLA's own model, and unsupported models (FLA's whole model as the oracle:
test_fla_oracle.py)."""

import os
import random

import pytest
import torch

import specla
from specla import DraftTree, PendingCommit, SpecConfig
from specla.errors import UnsupportedModelError
from specla.registry import get_plugin
from specla.tree import inclusive_ancestor_mask
from specla.ops.conv import conv_window_after
from specla.ops.naive import root_path
from specla.mixers.mamba2.naive import naive_tree_ssd
from specla.mixers.mamba2.reference import node_states, ssd_commit_factor, ssd_commit_replay, tree_ssd
from specla.testing import OracleDrafter, path_acceptance
from specla_fla.oracle import NaiveMamba2, naive_greedy_decode
from trees import SHAPES, TOL, batch_parents, f64, ragged_pending, rel_err, tree_parents


MODEL_TOL = 1e-9  # float64 models: batched factorized form vs sequential loop

MODEL_CONFIGS = get_plugin("mamba2").tiny_variants



def layer_commit(Bm, u, G, path, path_len):
    """A pending commit as the verify kernels take it."""
    from specla.records import LayerCommit
    from specla.mixers.mamba2.records import Mamba2FactorRecord

    return LayerCommit(Mamba2FactorRecord(Bm=Bm, u=u, G=G, conv_x=None), path, path_len)

def make_mamba2_model(name: str = "base", dtype: torch.dtype = torch.float64, seed: int = 0, **overrides):
    """The mamba2 plugin's conformance test model ``name`` (config fields ``overrides`` replaced)."""
    return get_plugin("mamba2").tiny_model(name, seed=seed, dtype=dtype, **overrides)


@pytest.fixture(params=list(MODEL_CONFIGS))
def model_name(request):
    return request.param





def paths_to(parents, node):
    """Padded root paths ending at ``node`` in every sequence, and their lengths."""
    paths = [torch.tensor(root_path(parents[b].tolist(), node)) for b in range(parents.shape[0])]
    return (torch.nn.utils.rnn.pad_sequence(paths, batch_first=True, padding_value=-1),
            torch.tensor([len(p) for p in paths]))


def ssd_inputs(B, T, H, P, G, N, dtype, gen, d_hdim=False):
    x = torch.randn(B, T, H, P, generator=gen, dtype=dtype)
    dt = torch.rand(B, T, H, generator=gen, dtype=dtype) * 0.9 + 0.05
    A = -torch.rand(H, generator=gen, dtype=dtype) * 1.5 - 0.1
    Bm = torch.randn(B, T, G, N, generator=gen, dtype=dtype)
    Cm = torch.randn(B, T, G, N, generator=gen, dtype=dtype)
    D = torch.randn(*((H, P) if d_hdim else (H,)), generator=gen, dtype=dtype)
    S0 = torch.randn(B, H, N, P, generator=gen, dtype=dtype)
    return x, dt, A, Bm, Cm, D, S0


# ---------------------------------------------------------------------------- reference ops


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kind", SHAPES)
@pytest.mark.parametrize("heads", [(4, 3, 2, 5, False), (3, 4, 3, 2, True)])  # (H, P, G, N, D per channel)
def test_tree_ssd_equals_per_path_recurrence(kind, heads, dtype):
    rng = random.Random(SHAPES.index(kind) * 10 + heads[0])  # fixed seeds: no str hashing
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    H, P, G, N, d_hdim = heads
    parents = batch_parents(kind, [7, 5, 1], rng)
    x, dt, A, Bm, Cm, D, S0 = ssd_inputs(3, parents.shape[1], H, P, G, N, dtype, gen, d_hdim)
    mask = inclusive_ancestor_mask(parents)
    y, u, Gs = tree_ssd(x, dt, dt * A, Bm, Cm, D, S0, mask)
    ry, ru, rG, rstates = naive_tree_ssd(x, dt, A, Bm, Cm, D, S0, parents)
    for got, ref in ((y, ry), (u, ru), (Gs, rG)):
        assert got.dtype == dtype and not got.isnan().any()
        assert rel_err(got, ref) < TOL[dtype]
    assert rel_err(node_states(S0, Bm, u, Gs, mask), rstates) < TOL[dtype]


@pytest.mark.parametrize("kind", SHAPES)
def test_commits_equal_state_after_each_node(kind):
    """For every node as the end of the accepted path: factor and replay commits equal the state
    after walking that node's root path serially; an empty path leaves the state bit-identical."""
    rng = random.Random(SHAPES.index(kind))
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    H, P, G, N = 4, 3, 2, 5
    parents = batch_parents(kind, [6, 4], rng)
    T = parents.shape[1]
    x, dt, A, Bm, Cm, D, S0 = ssd_inputs(2, T, H, P, G, N, torch.float64, gen)
    _, u, Gs = tree_ssd(x, dt, dt * A, Bm, Cm, D, S0, inclusive_ancestor_mask(parents))
    _, _, _, rstates = naive_tree_ssd(x, dt, A, Bm, Cm, D, S0, parents)
    for node in range(T):
        path, plen = paths_to(parents, node)
        for S in (ssd_commit_factor(S0, Bm, u, Gs, path, plen), ssd_commit_replay(S0, Bm, u, dt * A, path, plen)):
            assert rel_err(S, rstates[:, node]) < 1e-10
    # ragged: sequence 0 commits nothing (bit-identical), sequence 1 commits its node 0
    path, plen = torch.tensor([[-1], [0]]), torch.tensor([0, 1])
    for S in (ssd_commit_factor(S0, Bm, u, Gs, path, plen), ssd_commit_replay(S0, Bm, u, dt * A, path, plen)):
        assert torch.equal(S[0], S0[0])
        assert rel_err(S[1], rstates[1, 0]) < 1e-10


# ---------------------------------------------------------------------------- model level


def adapter_for(model, **cfg):
    return get_plugin("mamba2").make_adapter(model, SpecConfig(**cfg))


def states(adapter):
    """Each block's recurrent state ``[B, H, N, P]``."""
    return [m.S for m in adapter.mixers]


def windows(adapter):
    """Each block's conv window ``[B, C - 1, Dc]``."""
    return [m.conv for m in adapter.mixers]


def snapshot(adapter):
    return [s.clone() for s in states(adapter)] + [c.clone() for c in windows(adapter)]


def assert_bit_identical(a, b):
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def naive_after(model, tokens):
    """A NaiveMamba2 fed ``tokens``, and the logits after the last one."""
    dec = NaiveMamba2(model)
    logits = None
    for t in tokens:
        logits = dec.step(t)
    return dec, logits


def assert_state_matches(adapter, b, dec):
    for li, m in enumerate(adapter.mixers):
        ref = dec.states[li]
        assert float((m.S[b] - ref).abs().max()) < MODEL_TOL * max(1.0, float(ref.abs().max()))
        # same inputs, different matmul shapes: equal up to rounding
        assert float((m.conv[b] - dec.window(li)).abs().max()) < MODEL_TOL


@pytest.mark.parametrize("kind", SHAPES)
def test_verify_logits_equal_sequential_decoding(model_name, kind):
    rng = random.Random(SHAPES.index(kind))
    model = make_mamba2_model(model_name)
    V = model.config.vocab_size
    prompts = [[rng.randrange(V) for _ in range(n)] for n in (5, 1)]
    trees = []
    for n in (6, 3):
        par = tree_parents(kind, n, rng)
        trees.append(([rng.randrange(V) for _ in par], par))
    tree = DraftTree.from_lists(trees)
    adapter = adapter_for(model)
    adapter.prefill(prompts)
    before = snapshot(adapter)
    out = adapter.verify(tree)
    assert_bit_identical(before, snapshot(adapter))  # verify never writes the committed state
    assert out.logits.shape == (2, tree.width + 1, V)
    for b in range(2):
        _, ref = naive_after(model, prompts[b])
        assert float((out.logits[b, 0] - ref).abs().max()) < MODEL_TOL
        for i in range(int(tree.num_nodes[b])):
            _, ref = naive_after(model, prompts[b] + [int(tree.tokens[b, j]) for j in tree.path(b, i)])
            assert float((out.logits[b, i + 1] - ref).abs().max()) < MODEL_TOL


@pytest.mark.parametrize("commit", ["factor", "snapshot", "replay"])
@pytest.mark.parametrize("kind", ["chain", "binary", "random"])
def test_commit_every_path_equals_sequential_state(model_name, kind, commit):
    """Every accepted count 0..D and every node: verify + commit == decoding exactly the root and
    the accepted tokens, for the recurrent state and the conv window; 0 accepted of a sequence
    whose neighbour accepts leaves the state after the root only."""
    rng = random.Random(7)
    model = make_mamba2_model(model_name)
    V = model.config.vocab_size
    prompts = [[rng.randrange(V) for _ in range(4)], [rng.randrange(V) for _ in range(2)]]
    par = tree_parents(kind, 5, rng)
    tree = DraftTree.from_lists([([rng.randrange(V) for _ in par], par), ([rng.randrange(V)], [-1])])
    for end in range(-1, 5):
        adapter = adapter_for(model, engine={"commit": commit})
        adapter.prefill(prompts)
        out = adapter.verify(tree)
        adapter.commit(tree, out, path_acceptance(tree, [end, -1], [7, 8]))
        adapter.flush()
        accepted = [int(tree.tokens[0, j]) for j in (tree.path(0, end) if end >= 0 else [])]
        assert_state_matches(adapter, 0, naive_after(model, prompts[0] + accepted)[0])
        assert_state_matches(adapter, 1, naive_after(model, prompts[1])[0])
        assert adapter.roots.tolist() == [7, 8]


@pytest.mark.parametrize("commit", ["factor", "snapshot", "replay"])
def test_empty_commit_is_bit_identical(commit):
    adapter = adapter_for(make_mamba2_model("base"), engine={"commit": commit})
    adapter.prefill([[1, 2, 3], [4, 5]])
    tree = DraftTree.from_lists([([6, 7], [-1, 0]), ([8], [-1])])
    out = adapter.verify(tree)
    before = snapshot(adapter)
    adapter._apply(PendingCommit.from_records(out.records, torch.full((2, 1), -1), torch.zeros(2, dtype=torch.int64)))
    assert_bit_identical(before, snapshot(adapter))


@pytest.mark.parametrize("commit, eager", [("factor", False), ("factor", True), ("snapshot", False), ("replay", False)])
def test_two_steps_with_a_pending_commit_leave_the_sequential_state(commit, eager):
    """A branch accepted off the first child, then a chain, the factor commit delayed or flushed at
    once: the state and conv window equal the sequential walker's after the prompt, root 5 and the
    accepted [9, 6], then root 5 and the accepted [5, 3] (the suite checks that the strategies
    agree with each other)."""
    model = make_mamba2_model("g1_dhdim")
    prompt = [3, 1, 4, 1, 5]
    t1 = DraftTree.from_lists([([9, 2, 6], [-1, 0, 0])])
    t2 = DraftTree.from_lists([([5, 3], [-1, 0])])
    adapter = adapter_for(model, engine={"commit": commit})
    adapter.prefill([prompt])
    adapter.commit(t1, adapter.verify(t1), path_acceptance(t1, [2], [5]))
    if eager:
        adapter.flush()
    adapter.commit(t2, adapter.verify(t2), path_acceptance(t2, [1], [8]))
    adapter.flush()
    assert_state_matches(adapter, 0, naive_after(model, prompt + [9, 6, 5, 5, 3])[0])


def test_prefill_longer_than_one_chunk_beside_a_one_token_prompt():
    rng = random.Random(5)
    model = make_mamba2_model("odd")
    prompt = [rng.randrange(37) for _ in range(140)]  # > 2 prefill chunks of 64
    adapter = adapter_for(model)
    adapter.prefill([prompt, [4]])
    assert_state_matches(adapter, 0, naive_after(model, prompt[:-1])[0])


def test_score_is_teacher_forced_decoding():
    model = make_mamba2_model("nonorm_clamp")
    tokens = torch.tensor([[(7 * i + b) % 41 for i in range(70)] for b in range(2)])  # crosses a chunk
    logits = adapter_for(model).score(tokens)
    for b in range(2):
        dec = NaiveMamba2(model)
        for t in range(70):
            ref = dec.step(int(tokens[b, t]))
            if t % 23 == 0:
                assert float((logits[b, t] - ref).abs().max()) < MODEL_TOL


def test_state_stays_float32_with_bfloat16_activations():
    adapter = adapter_for(make_mamba2_model("base", dtype=torch.float32), dtype="bfloat16")
    adapter.prefill([[1, 2, 3, 4]])
    t = DraftTree.from_lists([([4, 5], [-1, 0])])
    out = adapter.verify(t)
    assert out.logits.dtype == torch.bfloat16
    assert all(r.u.dtype == torch.float32 and r.G.dtype == torch.float32 for r in out.records)
    adapter.commit(t, out, path_acceptance(t, [1], [9]))
    adapter.flush()
    assert all(s.dtype == torch.float32 and torch.isfinite(s).all() for s in states(adapter))


# ---------------------------------------------------------------------------- unsupported models
def test_unsupported_models_are_rejected_before_loading(tmp_path):
    plugin = get_plugin("mamba2")
    with pytest.raises(UnsupportedModelError, match="runs fla.models.Mamba2ForCausalLM"):
        plugin.make_adapter(torch.nn.Linear(2, 2), SpecConfig())
    model = make_mamba2_model("base", dtype=torch.float32)
    model.config.hidden_act = "gelu"
    with pytest.raises(UnsupportedModelError, match="activation 'gelu'"):
        plugin.check_model(model)
    (tmp_path / "config.json").write_text('{"model_type": "mamba2", "hidden_act": "relu"}')
    with pytest.raises(UnsupportedModelError, match="activation 'relu'"):  # no weights exist: raised first
        plugin.load_model(tmp_path, dtype=None, device=None)
    (tmp_path / "config.json").write_text('{"model_type": "gated_deltanet"}')
    with pytest.raises(UnsupportedModelError, match="model_type 'gated_deltanet'"):
        plugin.load_model(tmp_path, dtype=None, device=None)


# ---------------------------------------------------------------------------- end to end

N = 6


def reference(model, prompts, n):
    return [naive_greedy_decode(model, p, n) for p in prompts]


# acceptance patterns and the ngram drafter on every shape: the packaged conformance suite
# (tests/plugins/test_conformance_mamba2.py)


# ---------------------------------------------------------------------------- FLA as the oracle

fla_only = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                              reason="FLA runs its real kernels in this process (TRITON_INTERPRET != 1)")


@fla_only
def test_layer_decode_step_equals_fla_with_groups():
    """One cached decode step of FLA's Mamba2 layer (its torch path) from a random state and conv
    window, grouped B/C: output, state and conv window equal our tree verify of a one-node tree."""
    from fla_oracle import enable_fla_interpreter
    from specla.ops.norm import rms_norm

    enable_fla_interpreter()
    model = make_mamba2_model("base", dtype=torch.float32, seed=3)
    m = model.backbone.layers[0].mixer
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 16, generator=gen)  # block inputs; FLA's mixer gets their block norm
    state = torch.randn(2, m.num_heads, m.head_dim, m.ssm_state_size, generator=gen)  # FLA: [B, H, P, N]
    conv = torch.randn(2, m.conv_dim, m.conv_kernel_size, generator=gen)  # FLA: [B, Dc, C], oldest first
    adapter = adapter_for(model)
    adapter.mixers, adapter.num_layers = adapter.mixers[:1], 1  # the first block only
    norm = model.backbone.layers[0].norm  # the block norm the adapter reads (float32: no copy)
    norm_w, norm_eps = norm.weight.detach(), norm.eps
    hs = rms_norm(x, norm_w, norm_eps)[:, None]
    with torch.no_grad():
        ref, ref_conv, ref_state = m.torch_forward(hs, {"conv_state": conv.clone(), "recurrent_state": state.clone()})
    mixer = adapter.mixers[0]
    mixer.S = state.transpose(-1, -2).contiguous()  # ours: [B, H, N, P]
    mixer.conv = conv[..., 1:].transpose(1, 2).contiguous()  # the inputs before the new token
    adapter.embed_weight = x
    _, hidden, recs = adapter.forward(torch.tensor([[0], [1]]), torch.full((2, 1), -1), torch.ones(2, dtype=torch.int64),
                                      "factor", logits=False)
    assert float((hidden[:, 0] - x - ref[:, 0]).abs().max()) < 1e-5  # block output minus residual
    rec = recs[0]
    path, plen = torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, dtype=torch.int64)
    new_state = ssd_commit_factor(mixer.S, rec.Bm, rec.u, rec.G, path, plen)
    assert float((new_state - ref_state.transpose(-1, -2)).abs().max()) < 1e-5
    new_conv = conv_window_after(rec.conv_x, mixer.conv, path, plen)
    assert torch.equal(new_conv, ref_conv[..., 1:].transpose(1, 2))


# ---------------------------------------------------------------------------- Triton kernels
# CPU: the Triton interpreter at tiny float32 shapes; GPU: the same cases compiled. Outputs are
# pre-filled with NaN so an unwritten element fails.

DEV = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(DEV == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                                  reason="Triton kernels need a GPU or TRITON_INTERPRET=1")


def nan_out(B, T, H, P):
    nan = float("nan")
    return (torch.full((B, T, H, P), nan, device=DEV), torch.full((B, T, H, P), nan, device=DEV),
            torch.full((B, T, H), nan, device=DEV))


def pending_inputs(B, H, P, NG, N, gen, rng):
    """A previous step's tree, its factor records and ragged accepted paths (one sequence accepts
    nothing), with the naive state after each node."""
    Tp = 6
    parents = torch.tensor([tree_parents("random", Tp, rng) for _ in range(B)])
    x, dt, A, Bm, Cm, D, S0 = ssd_inputs(B, Tp, H, P, NG, N, torch.float32, gen)
    _, u, G, states = naive_tree_ssd(x, dt, A, Bm, Cm, D, S0, parents)
    ends = [rng.randrange(Tp) for _ in range(B)]
    ends[1] = -1
    paths = [root_path(parents[b].tolist(), e) if e >= 0 else [] for b, e in enumerate(ends)]
    L = max(len(p) for p in paths)
    path = torch.tensor([p + [-1] * (L - len(p)) for p in paths])
    plen = torch.tensor([len(p) for p in paths])
    committed = torch.stack([S0[b] if e < 0 else states[b, e] for b, e in enumerate(ends)])
    return S0, (Bm, u, G, path, plen), committed, ends


@needs_triton
@pytest.mark.parametrize("kind, tile", [("chain", 64), ("chain", 8), ("tree", 64), ("tree", 16)])
@pytest.mark.parametrize("shape", [(3, 5, 4, 3, 2, 5, False), (2, 7, 2, 17, 1, 3, True),
                                   (2, 4, 2, 3, 1, 37, False)])  # B, T, H, P, NG, N, D/channel
def test_verify_kernels_with_fused_ragged_commit_equal_naive(kind, tile, shape, monkeypatch):
    """serial_verify (chains, ragged lengths) and tree_verify (random trees) from a state with a
    pending ragged commit, each kernel's P tile at most ``tile`` wide (8 splits P = 17 in three,
    16 in two), the tree kernel's state size in blocks of 16 (N = 37 in three): the committed
    state equals the naive state after each accepted path (0 accepted: bit-identical), outputs
    and records equal the naive per-path recurrence from it."""
    from specla.mixers.mamba2 import verify as mamba2_verify
    from specla.mixers.mamba2.verify import serial_verify, tree_verify

    launch = "serial" if kind == "chain" else "tree"
    # "programs": 1, so that these small batches keep the tree kernel's widest tile
    monkeypatch.setitem(mamba2_verify.TUNING, launch, {**mamba2_verify.TUNING[launch], "BP": tile}
                        | ({"programs": 1, "BN": 16, "BN_split": 16} if launch == "tree" else {}))

    B, T, H, P, NG, N, d_hdim = shape
    rng = random.Random(sum(shape[:6]))
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    S0, pending, committed, ends = pending_inputs(B, H, P, NG, N, gen, rng)
    x, dt, A, Bm, Cm, D, _ = ssd_inputs(B, T, H, P, NG, N, torch.float32, gen, d_hdim)
    if kind == "chain":
        parents = torch.arange(-1, T - 1).expand(B, T)
        n = torch.tensor([T] + [rng.randrange(0, T + 1) for _ in range(B - 1)])
    else:
        parents = torch.tensor([tree_parents("random", T, rng) for _ in range(B)])
        n = torch.full((B,), T)
    state = S0.clone().to(DEV)
    args = [t.to(DEV) for t in (x, dt, dt * A, Bm, Cm, D)]
    fused = layer_commit(*(t.to(DEV) for t in pending))
    if kind == "chain":
        y, u, G = serial_verify(*args, state, n.to(DEV), pending=fused, out=nan_out(B, T, H, P))
    else:
        y, u, G = tree_verify(*args, state, inclusive_ancestor_mask(parents).to(DEV), pending=fused,
                              out=nan_out(B, T, H, P))
    ry, ru, rG, _ = naive_tree_ssd(x, dt, A, Bm, Cm, D, committed, parents)
    for b in range(B):
        if ends[b] < 0:
            assert torch.equal(state[b].cpu(), S0[b])
        else:
            assert rel_err(state[b].cpu(), committed[b]) < 1e-5
        m = int(n[b])
        for got, ref in ((y, ry), (u, ru), (G, rG)):
            assert not got[b].isnan().any()
            assert rel_err(got[b, :m].cpu(), ref[b, :m]) < 1e-5
            assert not got[b, m:].any()  # padding nodes of a chain get zeros


@needs_triton
@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_verify_with_a_pending_path_of_width_zero_commits_nothing(kind):
    """A pending commit whose path is ``[B, 0]`` (accepted by ``check_layer_commit``): the same
    outputs as without a pending commit, and the state bit-identical."""
    from specla.mixers.mamba2.verify import serial_verify, tree_verify

    B, T, H, P, NG, N = 2, 4, 2, 3, 1, 5
    rng = random.Random(31)
    gen = torch.Generator().manual_seed(31)
    S0, (Bm, u, G, _, _), _, _ = pending_inputs(B, H, P, NG, N, gen, rng)
    pending = layer_commit(*(t.to(DEV) for t in (Bm, u, G, torch.empty(B, 0, dtype=torch.int64),
                                                  torch.zeros(B, dtype=torch.int64))))
    x, dt, A, Bx, Cm, D, _ = ssd_inputs(B, T, H, P, NG, N, torch.float32, gen)
    args = [t.to(DEV) for t in (x, dt, dt * A, Bx, Cm, D)]
    if kind == "chain":
        run = lambda st, pend: serial_verify(*args, st, torch.full((B,), T, device=DEV), pending=pend,  # noqa: E731
                                             out=nan_out(B, T, H, P))
    else:
        parents = torch.tensor([tree_parents("random", T, rng) for _ in range(B)])
        run = lambda st, pend: tree_verify(*args, st, inclusive_ancestor_mask(parents).to(DEV),  # noqa: E731
                                           pending=pend, out=nan_out(B, T, H, P))
    state, plain = S0.clone().to(DEV), S0.clone().to(DEV)
    for got, ref in zip(run(state, pending), run(plain, None)):
        assert torch.equal(got, ref)
    assert torch.equal(state.cpu(), S0)


@needs_triton
def test_flush_commit_equals_naive_and_bad_inputs_raise():
    from specla.mixers.mamba2.commit import flush_commit

    rng = random.Random(9)
    gen = torch.Generator().manual_seed(9)
    S0, pending, committed, ends = pending_inputs(3, 4, 5, 2, 3, gen, rng)
    state = S0.clone().to(DEV)
    assert flush_commit(state, layer_commit(*(t.to(DEV) for t in pending))) is state
    assert torch.equal(state[1].cpu(), S0[1])  # 0 accepted: bit-identical
    assert rel_err(state.cpu(), committed) < 1e-5
    with pytest.raises(ValueError, match="float32"):
        flush_commit(S0.double(), layer_commit(*pending))
    with pytest.raises(ValueError, match="pending must be"):
        flush_commit(S0.clone(), layer_commit(pending[0], pending[1].double(), *pending[2:]))


@needs_triton
@pytest.mark.parametrize("verify_kernel", ["auto", "parallel"])
def test_triton_adapter_token_identical_to_reference(verify_kernel):
    """kernels="triton" end to end (chains through the serial kernel, trees through the parallel
    one, fused delayed commits, flush), token-identical to naive greedy decoding."""
    rng = random.Random(4)
    model = make_mamba2_model("g1_dhdim", dtype=torch.float32, seed=2)
    motif = [rng.randrange(41) for _ in range(4)]
    prompts = [motif * 3, [rng.randrange(41) for _ in range(N + 1)], [motif[1]]]
    cfg = dict(num_draft_tokens=N, max_depth=4, top_k=2, max_new_tokens=10, device=DEV,
               engine=dict(kernels="triton", verify_kernel=verify_kernel))
    result = specla.run(model, "mamba2", prompts=prompts, config=cfg)
    assert result.outputs == reference(model, prompts, 10)
    refs = reference(model, prompts, 10 + N)
    drafter = OracleDrafter(prompts, refs, "alternating", 41)
    result = specla.run(model, "mamba2", prompts=prompts, drafter=drafter, config={**cfg, "top_k": 1})
    assert result.outputs == [r[:10] for r in refs]


@needs_triton
def test_triton_adapter_tree_over_kernel_size_commits_then_runs_the_reference():
    """A tree wider than the parallel kernel's 64 nodes after a pending commit: the adapter flushes
    with the kernel, then verifies on the reference path; logits and states equal the reference
    adapter's."""
    model = make_mamba2_model("base", dtype=torch.float32, seed=6)
    rng = random.Random(6)
    t1 = DraftTree.from_lists([([4, 5, 6], [-1, 0, 1])], device=DEV)
    big = DraftTree.from_lists([([rng.randrange(41) for _ in range(64)], [-1] + [rng.randrange(-1, i) for i in range(1, 64)])],
                               device=DEV)
    got = {}
    for kernels in ("reference", "triton"):
        adapter = adapter_for(model, num_draft_tokens=64, max_depth=64, engine={"kernels": kernels}, device=DEV)
        adapter.prefill([[1, 2, 3]])
        adapter.commit(t1, adapter.verify(t1), path_acceptance(t1, [1], [7]))
        logits = adapter.verify(big).logits
        adapter.commit(big, adapter.verify(big), path_acceptance(big, [63], [8]))
        adapter.flush()
        got[kernels] = (logits.cpu(), [s.cpu() for s in snapshot(adapter)])
    assert rel_err(got["triton"][0], got["reference"][0]) < 1e-5
    for a, b in zip(got["triton"][1], got["reference"][1]):
        assert rel_err(a, b) < 1e-5


@pytest.mark.skipif(DEV != "cuda", reason="the Mamba2-1.3B layer shape needs a GPU")
@pytest.mark.parametrize("kernel", ["serial", "parallel", "flush"])
def test_kernels_at_mamba2_13b_layer_shape_bf16(kernel):
    """FLA Mamba2-1.3B layer (d_model 2048, expand 2, head dim 64: H=64, P=64, N=128, one group),
    bf16 x/B/C (dt, decay, D and the state float32), ragged pending commits (0..3 accepted):
    outputs (float32) within 1e-4 of the float64 naive reference on the same bf16-rounded inputs,
    u and G records and the committed state within 1e-5; a sequence with nothing pending keeps its
    state bit-identical."""
    from specla.mixers.mamba2.commit import flush_commit
    from specla.mixers.mamba2.verify import serial_verify, tree_verify

    B, H, P, NG, N, Tp = 4, 64, 64, 1, 128, 4
    rng = random.Random(13)
    T = 32 if kernel == "parallel" else 8
    if kernel == "parallel":  # root-explicit random trees: node 0 is the root
        parents = torch.tensor([[-1] + [rng.randrange(0, i) for i in range(1, T)] for _ in range(B)])
    else:
        parents = torch.arange(-1, T - 1).expand(B, T)
    gen = torch.Generator().manual_seed(29)
    x, dt, A, Bm, Cm, D, S0 = ssd_inputs(B, T, H, P, NG, N, torch.float32, gen)
    x, Bm, Cm = (t.bfloat16().float() for t in (x, Bm, Cm))  # the reference sees the rounded inputs
    pB, pu = torch.randn(B, Tp, NG, N, generator=gen).bfloat16(), torch.randn(B, Tp, H, P, generator=gen) * 0.5
    pG = -(torch.rand(B, Tp, H, generator=gen) * 0.5).cumsum(1)
    path, plen = ragged_pending()
    committed = ssd_commit_factor(f64(S0), f64(pB), f64(pu), f64(pG), path.to(DEV), plen.to(DEV))
    pending = tuple(t.to(DEV) for t in (pB, pu, pG, path, plen))
    state = S0.clone().to(DEV)


    if kernel == "flush":
        assert flush_commit(state, layer_commit(*pending)) is state
    else:
        args = [t.to(DEV) for t in (x.bfloat16(), dt, dt * A, Bm.bfloat16(), Cm.bfloat16(), D)]
        if kernel == "serial":
            y, u, G = serial_verify(*args, state, torch.full((B,), T, device=DEV), pending=layer_commit(*pending),
                                    out=nan_out(B, T, H, P))
        else:
            y, u, G = tree_verify(*args, state, inclusive_ancestor_mask(parents).to(DEV),
                                  pending=layer_commit(*pending), out=nan_out(B, T, H, P))
        ry, ru, rG, _ = naive_tree_ssd(f64(x), f64(dt), f64(A), f64(Bm), f64(Cm), f64(D),
                                       committed, parents)
        assert not any(t.isnan().any() for t in (y, u, G))
        assert rel_err(y.double(), ry) < 1e-4
        assert rel_err(u.double(), ru) < 1e-5 and rel_err(G.double(), rG) < 1e-5
    assert state.dtype == torch.float32
    assert rel_err(state.double(), committed) < 1e-5
    assert torch.equal(state[2].cpu(), S0[2])  # nothing pending for sequence 2: bit-identical


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="FLA's and the plugin's Triton kernels need a GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("variant", ["g1_dhdim", "odd"])
def test_whole_prompt_prefill_of_flas_mamba2_equals_sequential_decoding(variant, monkeypatch):
    """``prefill="chunked"`` on FLA's Mamba2 class: the SSD of each ragged prompt through FLA's
    chunked simple GLA in one pass, then tree drafts: outputs equal the sequential twin's greedy
    decoding (which the conformance suite checks against FLA's own forward)."""
    import transformers_checks

    transformers_checks.check_whole_prompt_prefill_equals_transformers(get_plugin("mamba2"), variant, None,
                                                                       monkeypatch)
