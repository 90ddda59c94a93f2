"""Model-level GDN reference path: verify and commit against plain sequential decoding (NaiveGDN)."""

import pytest
import torch

from specla import DraftTree, PendingCommit, SpecConfig
from specla.registry import get_plugin
from specla.testing import path_acceptance
from specla_fla.oracle import NaiveGDN
from conftest import make_model
from trees import SHAPES, tree_parents

TOL = 1e-9  # float64 models: batched factorized form vs sequential loop


def adapter_for(model, **cfg):
    return get_plugin("gdn").make_adapter(model, SpecConfig(**cfg))


def snapshot(adapter):
    return [m.S.clone() for m in adapter.mixers] + [m.conv.clone() for m in adapter.mixers if m.conv is not None]


def assert_bit_identical(a, b):
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def naive_after(model, tokens):
    """A NaiveGDN fed ``tokens``, and the logits after the last one."""
    dec = NaiveGDN(model)
    logits = None
    for t in tokens:
        logits = dec.step(t)
    return dec, logits


def assert_state_matches(adapter, b, dec):
    for li, m in enumerate(adapter.mixers):
        ref = dec.states[li]
        assert float((m.S[b] - ref).abs().max()) < TOL * max(1.0, float(ref.abs().max()))
        if m.conv is not None:
            # same inputs, different matmul shapes: equal up to rounding (bit-identity is tested
            # where the same code path runs twice)
            assert float((m.conv[b] - dec.window(li)).abs().max()) < TOL


@pytest.mark.parametrize("kind", SHAPES)
def test_verify_logits_equal_sequential_decoding(model_name, kind, rng):
    model = make_model(model_name)
    V = model.config.vocab_size
    prompts = [[rng.randrange(V) for _ in range(n)] for n in (5, 1)]
    trees = []
    for n in (6, 3):
        par = tree_parents(kind, n, rng) if kind != "single" else [-1]
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
        assert float((out.logits[b, 0] - ref).abs().max()) < TOL
        for i in range(int(tree.num_nodes[b])):
            path_tokens = [int(tree.tokens[b, j]) for j in tree.path(b, i)]
            _, ref = naive_after(model, prompts[b] + path_tokens)
            assert float((out.logits[b, i + 1] - ref).abs().max()) < TOL


@pytest.mark.parametrize("commit", ["factor", "snapshot", "replay"])
@pytest.mark.parametrize("kind", ["chain", "binary", "random"])
def test_commit_every_path_equals_sequential_state(model_name, kind, commit, rng):
    """Every accepted count 0..D and every node: verify + commit == decoding exactly the root and
    the accepted tokens, for the recurrent state and the conv window."""
    model = make_model(model_name)
    V = model.config.vocab_size
    prompt = [rng.randrange(V) for _ in range(4)]
    par = tree_parents(kind, 5, rng)
    tree = DraftTree.from_lists([([rng.randrange(V) for _ in par], par)])
    for end in [-1] + list(range(5)):
        adapter = adapter_for(model, engine={"commit": commit})
        adapter.prefill([prompt])
        out = adapter.verify(tree)
        adapter.commit(tree, out, path_acceptance(tree, [end], [7]))
        adapter.flush()
        accepted = [int(tree.tokens[0, j]) for j in (tree.path(0, end) if end >= 0 else [])]
        dec, _ = naive_after(model, prompt + accepted)
        assert_state_matches(adapter, 0, dec)
        assert adapter.roots.tolist() == [7]


@pytest.mark.parametrize("commit", ["factor", "snapshot", "replay"])
def test_empty_commit_is_bit_identical(commit):
    model = make_model("base")
    adapter = adapter_for(model, engine={"commit": commit})
    adapter.prefill([[1, 2, 3], [4, 5]])
    tree = DraftTree.from_lists([([6, 7], [-1, 0]), ([8], [-1])])
    out = adapter.verify(tree)
    before = snapshot(adapter)
    adapter._apply(PendingCommit.from_records(out.records, torch.full((2, 1), -1), torch.zeros(2, dtype=torch.int64)))
    assert_bit_identical(before, snapshot(adapter))


def test_a_prompt_beside_a_one_token_prompt_prefills_the_sequential_state():
    model = make_model("base")
    adapter = adapter_for(model)
    adapter.prefill([[1], list(range(1, 40))])
    assert_state_matches(adapter, 1, naive_after(model, list(range(1, 39)))[0])


def test_prefill_longer_than_one_chunk(rng):
    model = make_model("gva")
    prompt = [rng.randrange(61) for _ in range(150)]  # > 2 prefill chunks of 64
    adapter = adapter_for(model)
    adapter.prefill([prompt])
    assert_state_matches(adapter, 0, naive_after(model, prompt[:-1])[0])


def test_state_dtype_stays_float32_with_bfloat16_activations():
    model = make_model("base", dtype=torch.float32)
    adapter = adapter_for(model, dtype="bfloat16")
    adapter.prefill([[1, 2, 3, 4]])
    t = DraftTree.from_lists([([4, 5], [-1, 0])])
    out = adapter.verify(t)
    assert out.logits.dtype == torch.bfloat16
    assert all(r.delta.dtype == torch.float32 and r.G.dtype == torch.float32 for r in out.records)
    adapter.commit(t, out, path_acceptance(t, [1], [9]))
    adapter.flush()
    assert all(s.dtype == torch.float32 and torch.isfinite(s).all() for s in adapter.recurrent_states())


def test_score_is_teacher_forced_decoding_and_differentiable(rng):
    model = make_model("base")
    tokens = torch.tensor([[rng.randrange(61) for _ in range(70)] for _ in range(2)])  # crosses a chunk
    adapter = get_plugin("gdn").make_adapter(model, SpecConfig())
    logits = adapter.score(tokens)
    for b in range(2):
        dec = NaiveGDN(model)
        for t in range(0, 70, 23):  # spot-check positions in both chunks
            while len(dec.inputs[0]) <= t:
                ref = dec.step(int(tokens[b, len(dec.inputs[0])]))
            assert float((logits[b, t] - ref).abs().max()) < TOL
    assert not logits.requires_grad  # inference adapters never build graphs
    from specla.model.adapter import ModelAdapter
    from specla_fla.gdn import gdn_spec

    trainable = ModelAdapter(model, SpecConfig(), gdn_spec, differentiable=True)
    loss = torch.nn.functional.cross_entropy(trainable.score(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    for name in ("model.embeddings.weight", "model.layers.0.attn.A_log", "model.layers.1.attn.q_conv1d.weight",
                 "model.layers.1.mlp.down_proj.weight"):
        grad = dict(model.named_parameters())[name].grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0
