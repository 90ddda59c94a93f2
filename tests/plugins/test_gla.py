"""Gated Linear Attention (the op, specla.mixers.gla, and the gla plugin): reference ops vs their sequential twins, the model
path vs plain sequential decoding, every commit strategy, end to end token identity, unsupported
configs, and the Triton kernels (CPU: Triton interpreter). FLA's own GLAForCausalLM as the oracle:
test_fla_oracle.py."""

import copy
import functools
import os
import random

import pytest
import torch
import torch.nn.functional as F
from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM, GLAForCausalLM

import specla
from specla import DraftTree, PendingCommit, SpecConfig
from specla.errors import UnsupportedModelError
from specla.registry import get_plugin
from specla.tree import inclusive_ancestor_mask
from specla.ops.naive import root_path
from specla.mixers.gla.naive import naive_tree_gla
from specla.mixers.gla.reference import gla_commit_factor, gla_commit_replay, node_states, tree_gla
from specla.testing import OracleDrafter, path_acceptance
from specla_fla.oracle import NaiveGLA, naive_greedy_decode
from specla_fla.plugin import GLA_TINY_BASE, GLA_TINY_VARIANTS
from trees import SHAPES, f64, ragged_pending, rel_err, tree_parents

# the GLA-layer tests read every layer's GLA state; the hybrid variant ("attn") has its own tests
# (test_fla_hybrid.py) and the conformance suite's
GLA_CONFIGS = {k: v for k, v in GLA_TINY_VARIANTS.items() if k != "attn"}
TOL = 1e-9  # float64 models: batched factorized form vs sequential loop


@functools.lru_cache(maxsize=None)  # shared across tests (never modified): ids stay unique
def make_gla_model(name: str = "base", dtype: torch.dtype = torch.float64, seed: int = 0) -> GLAForCausalLM:
    """A random-initialised FLA GLAForCausalLM of shape ``name`` in ``dtype`` (the plugin's tiny_model)."""
    return get_plugin("gla").tiny_model(name, seed=seed, dtype=dtype)


@pytest.fixture(params=list(GLA_CONFIGS))
def gla_name(request):
    return request.param


@pytest.fixture
def rng():
    return random.Random(4321)


# ---------------------------------------------------------------------------- reference ops
def op_inputs(B, T, H, K, V, dtype, gen):
    q, k = torch.randn(B, T, H, K, generator=gen, dtype=dtype), torch.randn(B, T, H, K, generator=gen, dtype=dtype)
    v = torch.randn(B, T, H, V, generator=gen, dtype=dtype)
    gk = F.logsigmoid(torch.randn(B, T, H, K, generator=gen, dtype=dtype) * 2) / 2
    S0 = torch.randn(B, H, K, V, generator=gen, dtype=dtype)
    return q, k, v, gk, S0


def padded_paths(parents, ends):
    paths = [root_path(parents[b].tolist(), e) if e >= 0 else [] for b, e in enumerate(ends)]
    P = max(1, max(len(p) for p in paths))
    return torch.tensor([p + [-1] * (P - len(p)) for p in paths]), torch.tensor([len(p) for p in paths])


@pytest.mark.parametrize("kind", SHAPES)
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_reference_ops_equal_naive(kind, dtype, tol):
    rng = random.Random(len(kind) + (dtype == torch.float32))
    sizes = [1, 1, 1] if kind == "single" else [9, 4, 6]
    T = max(sizes)
    parents = torch.tensor([tree_parents(kind, n, rng) + [-1] * (T - n) for n in sizes])
    q, k, v, gk, S0 = op_inputs(3, T, 2, 5, 3, dtype, torch.Generator().manual_seed(rng.randrange(2**31)))
    mask = inclusive_ancestor_mask(parents)
    o, Gk = tree_gla(q, k, v, gk, S0, mask, 5**-0.5)
    ro, rGk, rstates = naive_tree_gla(q, k, v, gk, S0, parents, 5**-0.5)
    close = lambda a, b: float((a - b).abs().max()) < tol * max(1.0, float(b.abs().max()))  # noqa: E731
    assert o.dtype == dtype and close(o, ro) and close(Gk, rGk)
    assert close(node_states(S0, k, v, Gk, mask), rstates)
    for node in range(T):  # every accepted path, ragged across the batch (-1: nothing accepted)
        ends = [node, min(node, sizes[1] - 1), -1]
        path, plen = padded_paths(parents, ends)
        for commit in (gla_commit_factor(S0, k, v, Gk, path, plen), gla_commit_replay(S0, k, v, gk, path, plen)):
            assert close(commit[:2], torch.stack([rstates[0, ends[0]], rstates[1, ends[1]]]))
            assert torch.equal(commit[2], S0[2])  # nothing accepted: bit-identical


# ---------------------------------------------------------------------------- model level
def adapter_for(model, **cfg):
    return get_plugin("gla").make_adapter(model, SpecConfig(**cfg))


def snapshot(adapter):
    return [m.S.clone() for m in adapter.mixers] + [m.conv.clone() for m in adapter.mixers if m.conv is not None]


def assert_bit_identical(a, b):
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def naive_after(model, tokens, start=None):
    """A NaiveGLA fed ``tokens`` (continuing a copy of ``start`` if given), and the last logits."""
    if start is None:
        dec = NaiveGLA(model)
    else:
        dec = copy.copy(start)
        dec.states, dec.inputs = [s.clone() for s in start.states], [list(x) for x in start.inputs]
    logits = None
    for t in tokens:
        logits = dec.step(t)
    return dec, logits


def assert_state_matches(adapter, b, dec):
    for li, m in enumerate(adapter.mixers):
        ref = dec.states[li]
        assert float((m.S[b] - ref).abs().max()) < TOL * max(1.0, float(ref.abs().max()))
        if m.conv is not None:
            assert float((m.conv[b] - dec.window(li)).abs().max()) < TOL


@pytest.mark.parametrize("kind", SHAPES)
def test_verify_logits_equal_sequential_decoding(gla_name, kind, rng):
    model = make_gla_model(gla_name)
    V = model.config.vocab_size
    prompts = [[rng.randrange(V) for _ in range(n)] for n in (5, 1)]
    trees = [([rng.randrange(V) for _ in par], par) for par in (tree_parents(kind, n, rng) for n in (6, 3))]
    tree = DraftTree.from_lists(trees)
    adapter = adapter_for(model)
    adapter.prefill(prompts)
    before = snapshot(adapter)
    out = adapter.verify(tree)
    assert_bit_identical(before, snapshot(adapter))  # verify never writes the committed state
    assert out.logits.shape == (2, tree.width + 1, V)
    for b in range(2):
        base, ref = naive_after(model, prompts[b])
        assert float((out.logits[b, 0] - ref).abs().max()) < TOL
        for i in range(int(tree.num_nodes[b])):
            path_tokens = [int(tree.tokens[b, j]) for j in tree.path(b, i)]
            ref = naive_after(model, path_tokens, start=base)[1]
            assert float((out.logits[b, i + 1] - ref).abs().max()) < TOL


@pytest.mark.parametrize("commit", ["factor", "snapshot", "replay"])
def test_commit_every_path_equals_sequential_state(gla_name, commit, rng):
    """Every accepted count 0..D and every node: verify + commit == decoding exactly the root and
    the accepted tokens, for the recurrent state and the conv window; 0 accepted: bit-identical."""
    model = make_gla_model(gla_name)
    V = model.config.vocab_size
    prompt = [rng.randrange(V) for _ in range(4)]
    par = [-1, 0, 1, 0, 3, 1]  # two branches of depth 3 and a fork inside the first
    tree = DraftTree.from_lists([([rng.randrange(V) for _ in par], par)])
    base, _ = naive_after(model, prompt)
    for end in [-1] + list(range(len(par))):
        adapter = adapter_for(model, engine={"commit": commit})
        adapter.prefill([prompt])
        out = adapter.verify(tree)
        adapter.commit(tree, out, path_acceptance(tree, [end], [7]))
        adapter.flush()
        accepted = [int(tree.tokens[0, j]) for j in (tree.path(0, end) if end >= 0 else [])]
        assert_state_matches(adapter, 0, naive_after(model, accepted, start=base)[0])
        assert adapter.roots.tolist() == [7]
    adapter = adapter_for(model, engine={"commit": commit})
    adapter.prefill([prompt])
    out = adapter.verify(tree)
    before = snapshot(adapter)
    adapter._apply(PendingCommit.from_records(out.records, torch.full((1, 1), -1), torch.zeros(1, dtype=torch.int64)))
    assert_bit_identical(before, snapshot(adapter))


@pytest.mark.parametrize("commit, eager", [("factor", False), ("factor", True), ("snapshot", False), ("replay", False)])
def test_two_steps_with_a_pending_commit_leave_the_sequential_state(commit, eager):
    """A branch accepted off the first child, then a chain, the factor commit delayed or flushed at
    once: the state and conv window equal the sequential walker's after the prompt, root 5 and the
    accepted [9, 6], then root 5 and the accepted [5, 3] (the suite checks that the strategies
    agree with each other)."""
    model = make_gla_model("conv_gqa")
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


def test_prefill_longer_than_one_chunk_and_score(rng):
    model = make_gla_model("odd")
    prompt = [rng.randrange(37) for _ in range(150)]  # > 2 prefill chunks of 64
    adapter = adapter_for(model)
    adapter.prefill([prompt, [5]])
    assert_state_matches(adapter, 0, naive_after(model, prompt[:-1])[0])
    logits = adapter.score(torch.tensor([prompt[:70]]))
    dec = NaiveGLA(model)
    for t in range(70):
        ref = dec.step(prompt[t])
        if t % 23 == 0 or t == 69:
            assert float((logits[0, t] - ref).abs().max()) < TOL


def test_state_stays_float32_with_bfloat16_activations():
    model = make_gla_model("conv_gqa", dtype=torch.float32)
    adapter = adapter_for(model, dtype="bfloat16")
    adapter.prefill([[1, 2, 3, 4]])
    t = DraftTree.from_lists([([4, 5], [-1, 0])])
    out = adapter.verify(t)
    assert out.logits.dtype == torch.bfloat16
    assert all(r.Gk.dtype == torch.float32 and r.v.dtype == torch.float32 for r in out.records)
    adapter.commit(t, out, path_acceptance(t, [1], [9]))
    states = adapter.recurrent_states()  # applies the pending commit first
    assert adapter.pending is None and len(states) == 2
    assert all(s.dtype == torch.float32 and torch.isfinite(s).all() and s.abs().sum() > 0 for s in states)


# ---------------------------------------------------------------------------- unsupported models
@pytest.mark.parametrize("cfg, match", [
    (dict(feature_map="elu"), "feature_map 'elu'"),
    (dict(hidden_act="gelu"), "activation 'gelu'"),
    (dict(attnres_block_size=2), "attention residuals"),
])
def test_unsupported_configs_are_rejected_before_loading(cfg, match, tmp_path):
    plugin = get_plugin("gla")
    with pytest.raises(UnsupportedModelError, match=match):
        plugin.check_config({**GLA_TINY_BASE, "model_type": "gla", **cfg})
    (tmp_path / "config.json").write_text(__import__("json").dumps({**GLA_TINY_BASE, "model_type": "gla", **cfg}))
    with pytest.raises(UnsupportedModelError, match=match):  # no weights file: raised before loading
        plugin.load_model(tmp_path, dtype=None, device=None)


def test_wrong_model_class_and_checkpoint_rejected(tmp_path):
    gdn = GatedDeltaNetForCausalLM(GatedDeltaNetConfig(hidden_size=16, num_hidden_layers=1, num_heads=2,
                                                       head_dim=8, vocab_size=11))
    with pytest.raises(UnsupportedModelError, match="runs fla.models.GLAForCausalLM, got "
                                                    "fla.models.gated_deltanet.modeling_gated_deltanet.GatedDeltaNetForCausalLM$"):
        specla.run(gdn, "gla", prompts=[[1]], config=dict(max_new_tokens=1))
    (tmp_path / "config.json").write_text('{"model_type": "gated_deltanet"}')
    with pytest.raises(UnsupportedModelError, match="model_type 'gated_deltanet' is not one of"):
        get_plugin("gla").load_model(tmp_path, dtype=None, device=None)


def test_load_model_roundtrip_and_autodetect(tmp_path):
    from specla.registry import plugin_infos

    info = {p.name: p for p in plugin_infos()}["gla"]  # found through the specla.plugins entry point
    assert info.distribution == "specla" and info.model_types == ("gla",)
    model = make_gla_model("conv_gqa", dtype=torch.float32)
    model.save_pretrained(tmp_path)
    loaded = get_plugin("gla").load_model(tmp_path, dtype=torch.float32, device=None)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
    # the oracle decodes the loaded checkpoint: FLA's GLA layer does not save the tiny model's
    # gate_logit_normalizer (4, set on the layer), so the reloaded layers use FLA's default 16
    result = specla.run(loaded, None, prompts=[[1, 2, 3]], config=dict(max_new_tokens=6))
    assert result.outputs == [naive_greedy_decode(loaded, [1, 2, 3], 6)]


# ---------------------------------------------------------------------------- end to end
N = 6


_REFS: dict = {}


def reference(model, prompts, n):
    """Greedy continuations by NaiveGLA, cached per (model, prompt, n): tests share prompts."""
    for p in prompts:
        if (id(model), tuple(p), n) not in _REFS:
            _REFS[id(model), tuple(p), n] = naive_greedy_decode(model, p, n)
    return [_REFS[id(model), tuple(p), n] for p in prompts]


# every acceptance pattern per commit strategy and the ngram drafter on every shape: the packaged
# conformance suite (tests/plugins/test_conformance_gla.py)


def test_float32_token_identical(rng):
    model = make_gla_model("base", dtype=torch.float32, seed=3)
    prompts = [[rng.randrange(61) for _ in range(12)] * 2]
    result = specla.run(model, "gla", prompts=prompts, config=dict(max_new_tokens=30, top_k=2))
    assert result.outputs == reference(model, prompts, 30)


# ---------------------------------------------------------------------------- Triton kernels
# CPU: the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1); GPU: the same cases
# compiled. Outputs are pre-filled with NaN so an unwritten element fails.
DEV = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(DEV == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                                  reason="Triton kernels need CUDA or TRITON_INTERPRET=1")


def nan_out(B, T, H, K, V):
    return (torch.full((B, T, H, V), float("nan"), device=DEV), torch.full((B, T, H, K), float("nan"), device=DEV))


def chain(B, T):
    return torch.arange(-1, T - 1).expand(B, T)


def on_dev(*xs):
    return [x.to(DEV) for x in xs]


def layer_commit(k, v, Gk, path, path_len):
    """A pending commit as the verify kernels take it."""
    from specla.records import LayerCommit
    from specla.mixers.gla.records import GLAFactorRecord

    return LayerCommit(GLAFactorRecord(k=k, v=v, Gk=Gk, conv_x=None), path, path_len)


@needs_triton
@pytest.mark.parametrize("shape", [(3, 5, 2, 5, 6), (2, 4, 1, 16, 8), (1, 1, 1, 4, 4)])
def test_serial_verify_kernel_equals_naive_chains(shape):
    from specla.mixers.gla.verify import serial_verify

    B, T, H, K, V = shape
    q, k, v, gk, S0 = op_inputs(B, T, H, K, V, torch.float32, torch.Generator().manual_seed(sum(shape)))
    n = torch.tensor([T] + [random.Random(B + i).randrange(0, T + 1) for i in range(B - 1)])  # ragged chains
    state = S0.clone().to(DEV)
    o, G = serial_verify(*on_dev(q, k, v, gk), state, n.to(DEV), K**-0.5, out=nan_out(B, T, H, K, V))
    ro, rG, _ = naive_tree_gla(q, k, v, gk, S0, chain(B, T), K**-0.5)
    for b in range(B):
        m = int(n[b])
        for got, ref in ((o, ro), (G, rG)):
            assert not got[b].isnan().any()
            assert torch.allclose(got[b, :m].cpu(), ref[b, :m], rtol=1e-5, atol=1e-5)
            assert not got[b, m:].any()  # padding nodes get zeros
    assert torch.equal(state.cpu(), S0)  # no pending commit: the state is not written


@needs_triton
@pytest.mark.parametrize("kind", SHAPES)
def test_tree_verify_kernel_equals_naive(kind):
    from specla.mixers.gla.verify import tree_verify

    rng = random.Random(len(kind) * 7)
    sizes = [1, 1] if kind == "single" else [9, 5]
    T, H, K, V = max(sizes), 2, 5, 20  # V over one 16-wide tile
    parents = torch.tensor([tree_parents(kind, n, rng) + [-1] * (T - n) for n in sizes])
    q, k, v, gk, S0 = op_inputs(2, T, H, K, V, torch.float32, torch.Generator().manual_seed(rng.randrange(2**31)))
    state = S0.clone().to(DEV)
    o, G = tree_verify(*on_dev(q, k, v, gk), state, inclusive_ancestor_mask(parents).to(DEV), K**-0.5,
                       out=nan_out(2, T, H, K, V))
    ro, rG, _ = naive_tree_gla(q, k, v, gk, S0, parents, K**-0.5)
    for got, ref in ((o, ro), (G, rG)):
        assert not got.isnan().any()
        assert torch.allclose(got.cpu(), ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(state.cpu(), S0)


@needs_triton
@pytest.mark.parametrize("kernel", ["serial", "parallel", "flush"])
def test_fused_pending_commit_ragged(kernel):
    """Batch with ragged pending commits (0..D accepted): the committed state equals the state
    after walking each accepted path serially; nothing accepted leaves it bit-identical (not even
    written); then verify continues from the committed state."""
    from specla.mixers.gla.commit import flush_commit
    from specla.mixers.gla.verify import serial_verify, tree_verify

    B, Tp, T, H, K, V = 4, 6, 3, 2, 5, 6
    gen = torch.Generator().manual_seed(5)
    pq, pk, pv, pgk, S0 = op_inputs(B, Tp, H, K, V, torch.float64, gen)
    parents = torch.tensor([[-1, 0, 1, 2, 1, 0], [-1, -1, 1, 2, 3, 4], [-1, 0, 0, 0, 3, 3], [-1, 0, 1, 2, 3, 4]])
    _, pGk, pstates = naive_tree_gla(pq, pk, pv, pgk, S0, parents, K**-0.5)
    ends = [4, -1, 5, 5]
    path, plen = padded_paths(parents, ends)
    pending = on_dev(pk.float(), pv.float(), pGk.float(), path, plen)
    S0 = S0.float()
    q, k, v, gk, _ = op_inputs(B, T, H, K, V, torch.float32, gen)
    state = S0.clone().to(DEV)
    args = on_dev(q, k, v, gk)
    if kernel == "serial":
        o, _ = serial_verify(*args, state, torch.full((B,), T, device=DEV), K**-0.5, pending=layer_commit(*pending),
                             out=nan_out(B, T, H, K, V))
    elif kernel == "parallel":
        o, _ = tree_verify(*args, state, inclusive_ancestor_mask(chain(B, T)).to(DEV), K**-0.5, pending=layer_commit(*pending),
                           out=nan_out(B, T, H, K, V))
    else:
        assert flush_commit(state, layer_commit(*pending)) is state
    for b, e in enumerate(ends):
        if e < 0:
            assert torch.equal(state[b].cpu(), S0[b])
            committed = S0[b]
        else:
            committed = pstates[b, e].float()
            assert torch.allclose(state[b].cpu(), committed, rtol=1e-5, atol=1e-5)
        if kernel != "flush":
            ro, _, _ = naive_tree_gla(q[b : b + 1], k[b : b + 1], v[b : b + 1], gk[b : b + 1], committed[None],
                                      chain(1, T), K**-0.5)
            assert torch.allclose(o[b].cpu(), ro[0], rtol=1e-5, atol=1e-5)


@needs_triton
@pytest.mark.parametrize("kernel", ["serial", "parallel"])
def test_verify_with_a_pending_path_of_width_zero_commits_nothing(kernel):
    """A pending commit whose path is ``[B, 0]`` (accepted by ``check_layer_commit``): the same
    outputs as without a pending commit, and the state bit-identical."""
    from specla.mixers.gla.verify import serial_verify, tree_verify

    B, Tp, T, H, K, V = 2, 3, 4, 2, 5, 6
    gen = torch.Generator().manual_seed(29)
    _, pk, pv, pgk, _ = op_inputs(B, Tp, H, K, V, torch.float32, gen)
    pending = layer_commit(*on_dev(pk, pv, pgk.cumsum(1), torch.empty(B, 0, dtype=torch.int64),
                                   torch.zeros(B, dtype=torch.int64)))
    q, k, v, gk, S0 = op_inputs(B, T, H, K, V, torch.float32, gen)
    args = on_dev(q, k, v, gk)
    state, plain = S0.clone().to(DEV), S0.clone().to(DEV)
    if kernel == "serial":
        run = lambda st, pend: serial_verify(*args, st, torch.full((B,), T, device=DEV), K**-0.5,  # noqa: E731
                                             pending=pend, out=nan_out(B, T, H, K, V))
    else:
        run = lambda st, pend: tree_verify(*args, st, inclusive_ancestor_mask(chain(B, T)).to(DEV),  # noqa: E731
                                           K**-0.5, pending=pend, out=nan_out(B, T, H, K, V))
    for got, ref in zip(run(state, pending), run(plain, None)):
        assert torch.equal(got, ref)
    assert torch.equal(state.cpu(), S0)


@needs_triton
def test_kernels_reject_bad_input():
    from specla.mixers.gla.commit import flush_commit
    from specla.mixers.gla.verify import serial_verify, tree_verify

    q, k, v, gk, S0 = on_dev(*op_inputs(1, 3, 1, 4, 4, torch.float32, torch.Generator().manual_seed(0)))
    n = torch.full((1,), 3, device=DEV)
    with pytest.raises(ValueError, match="state must be float32"):
        serial_verify(q, k, v, gk, S0.double(), n, 0.5)
    with pytest.raises(ValueError, match="gk must be float32"):
        serial_verify(q, k, v, gk.bfloat16(), S0, n, 0.5)
    with pytest.raises(ValueError, match="num_nodes must be int64"):
        serial_verify(q, k, v, gk, S0, n.int(), 0.5)
    with pytest.raises(ValueError, match=r"v \[B, T, H, V\]"):
        serial_verify(q, k, v.expand(1, 3, 2, 4), gk, S0, n, 0.5)
    with pytest.raises(ValueError, match="mask must be bool"):
        tree_verify(q, k, v, gk, S0, torch.ones(1, 3, 3, device=DEV), 0.5)
    with pytest.raises(ValueError, match="pending must be"):
        flush_commit(S0, layer_commit(k, v, gk.double(), torch.zeros(1, 1, dtype=torch.int64, device=DEV),
                                      torch.zeros(1, dtype=torch.int64, device=DEV)))


@needs_triton
@pytest.mark.parametrize("name, verify_kernel, pattern", [
    ("conv_gqa", "auto", "alternating"), ("conv_gqa", "auto", "tree"), ("base", "auto", "zero_after_many"),
    ("odd", "serial", "tree"),
    ("clamp_nogate", "parallel", "alternating"),
])
def test_engine_with_triton_kernels_is_exact(name, verify_kernel, pattern, monkeypatch):
    """The whole engine with kernels="triton" (fused delayed commit inside the verify kernel) is
    token-identical to sequential decoding, and its states match the reference path's."""
    import specla.mixers.gla.verify as adapter_mod  # the mixer looks its verify kernels up there at each call

    calls = {"fused": 0, "plain": 0, "serial": 0, "parallel": 0}

    def counting(fn, kind):
        def wrapped(*args, pending=None, **kw):
            calls[kind] += 1
            calls["fused" if pending is not None else "plain"] += 1
            return fn(*args, pending=pending, **kw)
        return wrapped

    for kind in ("serial", "parallel"):
        fn = getattr(adapter_mod, "serial_verify" if kind == "serial" else "tree_verify")
        monkeypatch.setattr(adapter_mod, fn.__name__, counting(fn, kind))
    model = make_gla_model(name, dtype=torch.float32, seed=6)
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (1, 7, 12)]
    refs = reference(model, prompts, 20)
    states = {}
    for kernels in ("triton", "reference"):
        # a forced kernel runs eagerly: a recorded step cannot know on the host that a batch is a chain
        # fixed: both decoders on one schedule, their states are compared
        cfg = SpecConfig(num_draft_tokens=6, max_depth=6, max_new_tokens=12, device=DEV,
                         engine=dict(kernels=kernels, verify_kernel=verify_kernel, budget_policy="fixed",
                                     cuda_graphs="auto" if verify_kernel == "auto" else "off"))
        dec = specla.SpecDecoder(model, "gla", drafter=OracleDrafter(prompts, refs, pattern, V), config=cfg)
        assert dec.generate(prompts).outputs == [r[:12] for r in refs]
        dec.adapter.flush()
        states[kernels] = [s.cpu() for s in dec.adapter.recurrent_states()]
    for a, b in zip(states["triton"], states["reference"]):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)
    assert calls["fused"] > 0 and calls["plain"] > 0  # the kernels ran, with and without pending commits
    if pattern == "tree":
        assert calls["parallel"] > 0  # real trees (a forced serial falls back to the parallel kernel)
    if verify_kernel != "auto":
        assert calls[verify_kernel] > 0


@needs_triton
def test_trees_over_the_kernel_size_take_the_reference_path_after_a_flush():
    """kernels="triton" with a 65-node tree (64 drafts and the root, over tree_verify's 64): the pending commit is applied
    by the flush kernel, then the tree is verified on the reference path; logits equal the
    reference adapter's."""
    model = make_gla_model("base", dtype=torch.float32, seed=2)
    rng = random.Random(9)
    t1 = DraftTree.from_lists([([4, 5, 6], [-1, 0, 1])], device=DEV)
    par = tree_parents("random", 64, rng)
    t2 = DraftTree.from_lists([([rng.randrange(61) for _ in par], par)], device=DEV)
    acc = path_acceptance(t1, [1], [9])
    logits = {}
    for kernels in ("triton", "reference"):
        adapter = adapter_for(model, engine={"kernels": kernels}, device=DEV, num_draft_tokens=64, max_depth=64)
        adapter.prefill([[1, 2, 3]])
        adapter.commit(t1, adapter.verify(t1), acc)
        assert adapter.pending is not None
        logits[kernels] = adapter.verify(t2).logits.cpu()
    assert torch.allclose(logits["triton"], logits["reference"], rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(DEV != "cuda", reason="the GLA-1.3B layer shape needs a GPU")
@pytest.mark.parametrize("kernel", ["serial", "parallel", "flush"])
def test_kernels_at_gla13b_layer_shape_bf16(kernel):
    """FLA GLA-1.3B layer (hidden 2048: H=4, K=256, V=512 per head), bf16 q/k/v (gates and the
    state float32), ragged pending commits (0..3 accepted): outputs within 1e-2 of the float64
    naive reference on the same bf16-rounded inputs, Gk records and the committed state within
    1e-5; a sequence with nothing pending keeps its state bit-identical."""
    from specla.mixers.gla.commit import flush_commit
    from specla.mixers.gla.verify import serial_verify, tree_verify

    B, H, K, V, Tp = 4, 4, 256, 512, 4
    rng = random.Random(13)
    T = 32 if kernel == "parallel" else 8
    if kernel == "parallel":  # root-explicit random trees: node 0 is the root
        parents = torch.tensor([[-1] + [rng.randrange(0, i) for i in range(1, T)] for _ in range(B)])
    else:
        parents = chain(B, T)
    gen = torch.Generator().manual_seed(29)
    q, k, v, gk, S0 = op_inputs(B, T, H, K, V, torch.float32, gen)
    q, k, v = (x.bfloat16().float() for x in (q, k, v))  # the reference sees the rounded inputs
    pk, pv = torch.randn(B, Tp, H, K, generator=gen).bfloat16(), torch.randn(B, Tp, H, V, generator=gen).bfloat16()
    pGk = -(torch.rand(B, Tp, H, K, generator=gen) * 0.5).cumsum(1)
    path, plen = ragged_pending()
    committed = gla_commit_factor(f64(S0), f64(pk), f64(pv), f64(pGk), path.to(DEV), plen.to(DEV))
    pending = on_dev(pk, pv, pGk, path.to(DEV), plen.to(DEV))
    state = S0.clone().to(DEV)


    if kernel == "flush":
        assert flush_commit(state, layer_commit(*pending)) is state
    else:
        args = on_dev(q.bfloat16(), k.bfloat16(), v.bfloat16(), gk)
        out = (torch.full((B, T, H, V), float("nan"), device=DEV, dtype=torch.bfloat16), nan_out(B, T, H, K, V)[1])
        if kernel == "serial":
            o, G = serial_verify(*args, state, torch.full((B,), T, device=DEV), K**-0.5, pending=layer_commit(*pending), out=out)
        else:
            o, G = tree_verify(*args, state, inclusive_ancestor_mask(parents).to(DEV), K**-0.5, pending=layer_commit(*pending),
                               out=out)
        ro, rG, _ = naive_tree_gla(f64(q), f64(k), f64(v), f64(gk), committed, parents, K**-0.5)
        assert not o.isnan().any() and not G.isnan().any()
        assert o.dtype == torch.bfloat16 and G.dtype == torch.float32
        assert rel_err(o.double(), ro) < 1e-2
        assert rel_err(G.double(), rG) < 1e-5
    assert state.dtype == torch.float32
    assert rel_err(state.double(), committed) < 1e-5
    assert torch.equal(state[2].cpu(), S0[2])  # nothing pending for sequence 2: bit-identical


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="FLA's and the plugin's Triton kernels need a GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("variant", ["conv_gqa", "clamp_nogate", "attn"])
def test_whole_prompt_prefill_of_flas_gla_equals_sequential_decoding(variant, monkeypatch):
    """``prefill="chunked"`` on FLA's GLA class (with and without short conv, grouped key/value
    heads, the decay clamp, the hybrid with attention layers): each ragged prompt through FLA's
    chunked GLA in one pass, then tree drafts: outputs equal the sequential twin's greedy
    decoding (which the conformance suite checks against FLA's own forward)."""
    import transformers_checks

    transformers_checks.check_whole_prompt_prefill_equals_transformers(get_plugin("gla"), variant, None,
                                                                       monkeypatch)
