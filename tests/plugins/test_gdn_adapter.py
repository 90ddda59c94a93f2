"""Model-level GDN reference path: verify and commit against plain sequential decoding (NaiveGDN)."""

import pytest
import torch

from specla import Acceptance, BudgetError, DraftTree, InvalidTokenError, InvalidTreeError, SpecConfig
from specla.records import PendingCommit
from specla.registry import get_plugin
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


def acceptance_for(tree, b_ends, bonus):
    """An Acceptance following, per sequence, the root path of draft node ``b_ends[b]`` (-1: none)."""
    B = tree.batch_size
    paths = [[0] + [n + 1 for n in (tree.path(b, e) if e >= 0 else [])] for b, e in enumerate(b_ends)]
    P = max(len(p) for p in paths)
    path = torch.tensor([p + [-1] * (P - len(p)) for p in paths])
    num = torch.tensor([len(p) - 1 for p in paths])
    toks = torch.tensor([[int(tree.tokens[b, n - 1]) for n in p[1:]] + [-1] * (P - len(p)) for b, p in enumerate(paths)])
    return Acceptance(path=path, num_accepted=num, bonus=torch.tensor(bonus), tokens=toks.view(B, P - 1))


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
        adapter.commit(tree, out, acceptance_for(tree, [end], [7]))
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
    adapter._apply(out.records, torch.full((2, 1), -1), torch.zeros(2, dtype=torch.int64))
    assert_bit_identical(before, snapshot(adapter))


def test_short_prompt_in_a_batch_keeps_an_exactly_empty_state():
    model = make_model("base")
    adapter = adapter_for(model)
    adapter.prefill([[1], list(range(1, 40))])
    assert all(not m.S[0].any() and not m.conv[0].any() for m in adapter.mixers)
    assert_state_matches(adapter, 1, naive_after(model, list(range(1, 39)))[0])


def test_prefill_longer_than_one_chunk(rng):
    model = make_model("gva")
    prompt = [rng.randrange(61) for _ in range(150)]  # > 2 prefill chunks of 64
    adapter = adapter_for(model)
    adapter.prefill([prompt])
    assert_state_matches(adapter, 0, naive_after(model, prompt[:-1])[0])


def test_strategies_agree_and_delayed_equals_eager(rng):
    model = make_model("expand_v2")
    prompt = [3, 1, 4, 1, 5]
    t1 = DraftTree.from_lists([([9, 2, 6], [-1, 0, 0])])
    t2 = DraftTree.from_lists([([5, 3], [-1, 0])])
    logits, states = {}, {}
    for name, commit, eager in [("factor", "factor", False), ("factor_eager", "factor", True),
                                ("snapshot", "snapshot", False), ("replay", "replay", False)]:
        adapter = adapter_for(model, engine={"commit": commit})
        adapter.prefill([prompt])
        out = adapter.verify(t1)
        adapter.commit(t1, out, acceptance_for(t1, [2], [5]))
        if eager:
            adapter.flush()
        if commit == "factor":
            assert (adapter.pending is None) == eager
        logits[name] = adapter.verify(t2).logits  # applies the pending commit first
        adapter.commit(t2, adapter.verify(t2), acceptance_for(t2, [1], [8]))
        adapter.flush()
        once = snapshot(adapter)
        adapter.flush()  # idempotent
        assert_bit_identical(once, snapshot(adapter))
        states[name] = once
    for name in ("factor_eager", "snapshot", "replay"):
        assert float((logits[name] - logits["factor"]).abs().max()) < TOL
        for a, b in zip(states[name], states["factor"]):
            assert float((a - b).abs().max()) < TOL
    assert_bit_identical(states["factor"], states["factor_eager"])  # same ops, same order


def test_ragged_batch_equals_per_sequence_runs(rng):
    model = make_model("base")
    prompts = [[rng.randrange(61) for _ in range(n)] for n in (3, 8, 1)]
    trees = [([1, 2, 3, 4], [-1, 0, 1, 2]), ([5, 6, 7], [-1, -1, 0]), ([], [])]
    ends = [3, 2, -1]
    batch = adapter_for(model)
    batch.prefill(prompts)
    tree = DraftTree.from_lists(trees)
    batch.commit(tree, batch.verify(tree), acceptance_for(tree, ends, [1, 2, 3]))
    batch.flush()
    for b in range(3):
        single = adapter_for(model)
        single.prefill([prompts[b]])
        t = DraftTree.from_lists([trees[b]])
        single.commit(t, single.verify(t), acceptance_for(t, [ends[b]], [b + 1]))
        single.flush()
        for x, y in zip(single.recurrent_states(), batch.recurrent_states()):
            assert float((x[0] - y[b]).abs().max()) < 1e-12
        for x, y in zip([m.conv for m in single.mixers], [m.conv for m in batch.mixers]):
            assert float((x[0] - y[b]).abs().max()) < 1e-12
    # select keeps sequences in the given order, pending commit included
    batch.verify(tree)
    batch.commit(tree, batch.verify(tree), acceptance_for(tree, ends, [4, 5, 6]))
    before = snapshot(batch)
    batch.select(torch.tensor([2, 0]))
    assert batch.roots.tolist() == [6, 4]
    assert isinstance(batch.pending, PendingCommit) and batch.pending.path.shape[0] == 2
    batch.flush()
    assert batch.mixers[0].S.shape[0] == 2 and not torch.equal(batch.mixers[0].S[1], before[0][0])


@pytest.mark.parametrize(
    "tree, error, match",
    [
        (DraftTree.from_lists([([1] * 9, list(range(-1, 8)))]), BudgetError, "over the budget N=8"),
        (DraftTree.from_lists([([1, 61], [-1, 0])]), InvalidTokenError, "token id 61"),
        (DraftTree.from_lists([([1, -100], [-1, 0])]), InvalidTokenError, "token id -100"),
        (DraftTree.from_lists([([1], [-1]), ([2], [-1])]), InvalidTreeError, "batch 2 != adapter batch 1"),
    ],
)
def test_bad_trees_raise_and_leave_state_untouched(tree, error, match):
    adapter = adapter_for(make_model("base"), num_draft_tokens=8, max_depth=8)
    adapter.prefill([[1, 2, 3]])
    t = DraftTree.from_lists([([4, 5], [-1, 0])])
    adapter.commit(t, adapter.verify(t), acceptance_for(t, [1], [9]))  # leaves a pending commit
    before, pending, roots = snapshot(adapter), adapter.pending, adapter.roots.clone()
    with pytest.raises(error, match=match):
        adapter.verify(tree)
    assert_bit_identical(before, snapshot(adapter))
    assert adapter.pending is pending and torch.equal(adapter.roots, roots)


@pytest.mark.parametrize(
    "prompts, match",
    [([[1, 2], []], "prompt 1 is empty"), ([[1, 61]], "token id 61"), ([[-1, 3]], "token id -1"),
     ([], "no prompts"), ([[1, 2.5]], "position 1: token ids must be integers, got float 2.5")],
)
def test_bad_prompts_raise_and_leave_state_untouched(prompts, match):
    adapter = adapter_for(make_model("base"))
    adapter.prefill([[5, 6, 7]])
    before, roots = snapshot(adapter), adapter.roots.clone()
    with pytest.raises(InvalidTokenError, match=match):
        adapter.prefill(prompts)
    assert_bit_identical(before, snapshot(adapter))
    assert torch.equal(adapter.roots, roots)


def test_state_dtype_stays_float32_with_bfloat16_activations():
    model = make_model("base", dtype=torch.float32)
    adapter = adapter_for(model, dtype="bfloat16")
    adapter.prefill([[1, 2, 3, 4]])
    t = DraftTree.from_lists([([4, 5], [-1, 0])])
    out = adapter.verify(t)
    assert out.logits.dtype == torch.bfloat16
    assert all(r.delta.dtype == torch.float32 and r.G.dtype == torch.float32 for r in out.records)
    adapter.commit(t, out, acceptance_for(t, [1], [9]))
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
