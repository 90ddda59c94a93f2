"""Lossless sampling over draft trees (specla.acceptance.accept_sampling): a statistical test
against the exact target distribution, one that fails when the acceptance rule is broken, the
deterministic-draft case, seeded repeats, and the sampling warpers."""

import itertools
import re

import pytest
import torch

import specla.acceptance as acc
from specla import DraftTree
from specla.registry import get_plugin

V, L, TRIALS = 4, 4, 60_000  # vocabulary, generated tokens compared, independent runs


def markov(seed):
    """Random order-1 target P and drafter Q (rows: previous token), deliberately different."""
    g = torch.Generator().manual_seed(seed)
    P = torch.softmax(torch.randn(V, V, generator=g) * 1.5, -1)
    Q = torch.softmax(torch.randn(V, V, generator=g) * 1.5, -1)
    return P, Q


def generate(P, Q, accept, start=0, deterministic=False, seed=0, q_none=False):
    """TRIALS independent speculative generations of L tokens with the tree
    root -> (c1, c2), c1 -> c3; drafts drawn from Q (or Q's argmax, one-hot, when deterministic;
    ``q_none``: deterministic drafts passed as ``draft_probs=None``, the draw-and-match path)."""
    g = torch.Generator().manual_seed(seed)
    out = torch.full((TRIALS, L + 4), -1)
    n = torch.zeros(TRIALS, dtype=torch.int64)
    root = torch.full((TRIALS,), start)
    parents = torch.tensor([-1, -1, 0]).expand(TRIALS, 3)
    rows = torch.arange(TRIALS)
    while bool((n < L).any()):
        def draw(prev):
            if deterministic:
                return Q[prev].argmax(-1)
            return torch.multinomial(Q[prev], 1, generator=g).squeeze(-1)

        c1, c2 = draw(root), draw(root)
        if deterministic:  # two deterministic siblings must differ: take Q's second choice
            c2 = Q[root].topk(2, -1).indices[:, 1]
        c3 = draw(c1)
        toks = torch.stack([c1, c2, c3], 1)
        tree = DraftTree(toks, parents.clone(), torch.full((TRIALS,), 3))
        target = torch.stack([P[root], P[c1], P[c2], P[c3]], 1)
        q = torch.stack([Q[root], Q[root], Q[c1]], 1)
        if deterministic:
            q = None if q_none else torch.nn.functional.one_hot(toks, V).float()
        a = accept(tree, target, q, g)
        emitted = torch.cat([a.tokens, a.bonus[:, None]], 1)  # accepted drafts (-1 padded), bonus
        for j in range(emitted.shape[1]):
            ok = (emitted[:, j] >= 0) & (n < L + 4)
            out[rows[ok], n[ok]] = emitted[ok, j]
            n = n + ok.long()
        root = out[rows, n - 1]
    return out[:, :L]


def chi_square(samples, P, start=0):
    """Pearson chi-square of the L-token sequences against the exact Markov probabilities."""
    idx = (samples * (V ** torch.arange(L - 1, -1, -1))).sum(-1)
    observed = torch.bincount(idx, minlength=V**L).double()
    expected = torch.zeros(V**L, dtype=torch.float64)
    for seq in itertools.product(range(V), repeat=L):
        prob, prev = 1.0, start
        for t in seq:
            prob, prev = prob * float(P[prev, t]), t
        expected[sum(t * V ** (L - 1 - i) for i, t in enumerate(seq))] = prob * TRIALS
    keep = expected > 5  # the usual validity condition of the test
    return float(((observed - expected)[keep] ** 2 / expected[keep]).sum()), int(keep.sum()) - 1


def bound(df):
    return df + 6 * (2 * df) ** 0.5  # mean + 6 standard deviations of chi-square(df)


@pytest.mark.parametrize("deterministic,q_none", [(False, False), (True, False), (True, True)])
def test_tree_sampling_follows_the_target_distribution(deterministic, q_none):
    P, Q = markov(1)
    stat, df = chi_square(generate(P, Q, acc.accept_sampling, deterministic=deterministic, q_none=q_none), P)
    assert stat < bound(df), (stat, df)


def test_the_draw_and_match_path_fails_the_test_when_it_ignores_the_draws():
    """Following a child whatever the draw (accepting every draft) skews the output: the chi-square
    test sees it on the deterministic path too."""

    def broken(tree, target, q, g):
        a = acc.accept_sampling(tree, target, None, g)
        greedy = acc._walk(tree, torch.cat([tree.tokens[:, :1], tree.tokens[:, 2:3], tree.tokens[:, :2]], 1), None)
        return acc.Acceptance(greedy.path, greedy.num_accepted, a.bonus, greedy.tokens)

    P, Q = markov(1)
    stat, df = chi_square(generate(P, Q, broken, deterministic=True, q_none=True), P)
    assert stat > 3 * bound(df), (stat, df)


def test_sample_tokens_draws_by_inverse_cdf_and_never_a_zero_probability_token():
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0]] * 5)
    u = torch.tensor([0.0, 0.2499, 0.25, 0.9, 1.0 - 2**-24])
    assert acc.sample_tokens(probs, u).tolist() == [1, 1, 3, 3, 3]
    unnormalised = torch.tensor([[2.0, 0.0, 2.0]])
    assert acc.sample_tokens(unnormalised, torch.tensor([0.49])).tolist() == [0]
    assert acc.sample_tokens(unnormalised, torch.tensor([0.5])).tolist() == [2]
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(3, 50, generator=g), -1).masked_fill(torch.rand(3, 50, generator=g) < 0.5, 0.0)
    draws = acc.sample_tokens(p[:, None].expand(3, 20000, 50), torch.rand(3, 20000, generator=g))
    assert bool((p.gather(1, draws) > 0).all())
    freq = torch.stack([torch.bincount(d, minlength=50) for d in draws]).double() / 20000
    torch.testing.assert_close(freq, (p / p.sum(-1, keepdim=True)).double(), atol=0.015, rtol=0)
    with pytest.raises(ValueError, match=r"uniforms must be \(3, 20000\), got \(3,\)"):
        acc.sample_tokens(p[:, None].expand(3, 20000, 50), torch.rand(3))


def test_the_test_fails_when_the_acceptance_rule_is_broken():
    """Accepting drafts with probability r(x) (ignoring q) skews the output towards the drafter."""

    def broken(tree, target, q, g):
        return acc.accept_sampling(tree, target, torch.ones_like(q), g)

    P, Q = markov(1)
    stat, df = chi_square(generate(P, Q, broken), P)
    assert stat > 3 * bound(df), (stat, df)


def test_a_seeded_run_repeats_exactly_and_another_seed_differs():
    P, Q = markov(2)
    first = generate(P, Q, acc.accept_sampling, seed=5)
    assert torch.equal(first, generate(P, Q, acc.accept_sampling, seed=5))
    assert not torch.equal(first, generate(P, Q, acc.accept_sampling, seed=6))


def test_sampling_probs_temperature_top_k_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    assert torch.allclose(acc.sampling_probs(logits, 1.0), torch.softmax(logits, -1))
    assert torch.allclose(acc.sampling_probs(logits, 0.5), torch.softmax(logits / 0.5, -1))
    top2 = acc.sampling_probs(logits, 1.0, top_k=2)
    assert torch.allclose(top2[0, :2], torch.softmax(logits[0, :2], -1)) and not top2[0, 2:].any()
    p = torch.softmax(logits, -1)[0]  # 0.61, 0.22, 0.14, 0.03
    nucleus = acc.sampling_probs(logits, 1.0, top_p=0.7)  # the first two reach 0.7
    assert torch.allclose(nucleus[0], torch.cat([p[:2] / p[:2].sum(), torch.zeros(2)]))
    assert torch.equal(acc.sampling_probs(logits, 1.0, top_p=0.5)[0] > 0, torch.tensor([True, False, False, False]))
    with pytest.raises(ValueError, match="temperature > 0"):
        acc.sampling_probs(logits, 0.0)


@pytest.mark.parametrize("temperature", [1e30, 1e300])
def test_top_k_keeps_its_set_at_a_huge_temperature(temperature):
    """``logits / T`` rounds to ties at a huge ``T``; the top-k set is the logits' own, so
    ``top_k = 1`` still samples the greedy token and ``top_k = 2`` the two best, evenly."""
    logits = torch.tensor([[2.0, 5.0, -1.0, 4.0], [0.0, -3.0, 1.0, 0.5]])
    assert acc.sampling_probs(logits, temperature, top_k=1).tolist() == [[0, 1, 0, 0], [0, 0, 1, 0]]
    assert acc.sampling_probs(logits, temperature, top_k=2).tolist() == [[0, 0.5, 0, 0.5], [0, 0, 0.5, 0.5]]


def test_shapes_are_checked():
    tree = DraftTree.from_lists([([1], [-1])])
    with pytest.raises(ValueError, match="target_probs"):
        acc.accept_sampling(tree, torch.rand(1, 1, V), torch.rand(1, 1, V))
    with pytest.raises(ValueError, match="draft_probs"):
        acc.accept_sampling(tree, torch.rand(1, 2, V), torch.rand(1, 2, V))


# ---------------------------------------------------------------------------- through the engine
@pytest.mark.parametrize("device,graphs", [("cpu", "off"), ("cpu", "unrecorded"), pytest.param(
    "cuda", "on", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))])
def test_engine_sampling_follows_the_model_distribution_and_repeats_with_a_seed(device, graphs):
    """A tiny GDN model, 3000 copies of one prompt, two sampled tokens with temperature 0.6 and
    an oracle drafter proposing two-token chains: the joint distribution of the two tokens
    equals the model's own (exact, from sequential decoding); a seed repeats the run. Eagerly
    and with the fixed-shape graph step (unrecorded on the CPU, recorded on CUDA; its batch runs
    as 4096 rows)."""
    from specla import SpecDecoder
    from specla.registry import get_plugin
    from specla.testing import OracleDrafter
    from specla_fla.oracle import NaiveGDN

    arch = get_plugin("gdn")
    model = arch.tiny_model("base", seed=4, dtype=torch.float32)
    prompt, n = [3, 14, 15, 9, 2], 3000
    ref = arch.reference_decode(model, prompt, 6)
    cfg = dict(temperature=0.6, max_new_tokens=2, num_draft_tokens=2, max_depth=2, seed=11,
               engine=dict(cuda_graphs=graphs), device=device)
    dec = SpecDecoder(model, "gdn", drafter=OracleDrafter([prompt] * n, [ref] * n, "all", 61), config=cfg)
    out = dec.generate([prompt] * n)
    assert out.stats.mean_accepted_tokens > 0.05  # hundreds of drafts accepted, not just bonus tokens
    pairs = torch.tensor(out.outputs)
    first = NaiveGDN(model)
    for t in prompt:
        p1 = torch.softmax(first.step(t).double() / 0.6, -1)
    observed = torch.bincount(pairs[:, 0] * 61 + pairs[:, 1], minlength=61 * 61).double()
    expected = torch.zeros(61 * 61, dtype=torch.float64)
    for x1 in range(61):
        if p1[x1] * n < 1:
            continue
        dec1 = NaiveGDN(model)
        for t in prompt + [x1]:
            logits = dec1.step(t)
        expected[x1 * 61 : (x1 + 1) * 61] = p1[x1] * torch.softmax(logits.double() / 0.6, -1) * n
    keep = expected > 5
    stat = float(((observed - expected)[keep] ** 2 / expected[keep]).sum())
    assert stat < bound(int(keep.sum()) - 1), stat
    again = SpecDecoder(model, "gdn", drafter=OracleDrafter([prompt] * n, [ref] * n, "all", 61), config=cfg)
    assert again.generate([prompt] * n).outputs == out.outputs


def test_engine_sampling_with_the_eagle_drafters_q_follows_the_model_distribution(monkeypatch):
    """The EAGLE drafter samples its draft tree from its own (untrained, so different) distribution
    and hands ``q`` to the acceptance rule: two sampled tokens of a tiny GDN model still follow
    the model's exact joint distribution (chi-square), the rule did receive ``q``, and a seed
    repeats the run."""
    from specla import SpecDecoder
    from specla import acceptance as acc
    from specla.drafters.eagle import EagleDrafter, EagleHead
    from specla.registry import get_plugin
    from specla_fla.oracle import NaiveGDN

    arch = get_plugin("gdn")
    model = arch.tiny_model("base", seed=4, dtype=torch.float32)
    prompt, n, temp = [3, 14, 15, 9, 2], 3000, 0.6
    torch.manual_seed(0)
    head = EagleHead(model.config.hidden_size)
    seen = []
    real = acc.accept_sampling

    def spy(tree, target, q, generator=None, **kw):
        seen.append(q is not None and tree.draft_probs is not None)
        return real(tree, target, q, generator, **kw)

    monkeypatch.setattr("specla.step.accept_sampling", spy)
    cfg = dict(temperature=temp, max_new_tokens=2, num_draft_tokens=3, max_depth=2, top_k=2, seed=5)
    out = SpecDecoder(model, "gdn", drafter=EagleDrafter(head), config=cfg).generate([prompt] * n)
    assert seen and all(seen)
    assert out.stats.mean_accepted_tokens > 0.05
    pairs = torch.tensor(out.outputs)
    first = NaiveGDN(model)
    for t in prompt:
        p1 = torch.softmax(first.step(t).double() / temp, -1)
    V = p1.shape[0]
    observed = torch.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V).double()
    expected = torch.zeros(V * V, dtype=torch.float64)
    for x1 in range(V):
        if p1[x1] * n < 1:
            continue
        dec1 = NaiveGDN(model)
        for t in prompt + [x1]:
            logits = dec1.step(t)
        expected[x1 * V : (x1 + 1) * V] = p1[x1] * torch.softmax(logits.double() / temp, -1) * n
    keep = expected > 5
    stat = float(((observed - expected)[keep] ** 2 / expected[keep]).sum())
    assert stat < bound(int(keep.sum()) - 1), stat
    again = SpecDecoder(model, "gdn", drafter=EagleDrafter(head), config=cfg).generate([prompt] * n)
    assert again.outputs == out.outputs


def test_keyed_uniforms_depend_on_the_seed_sequence_and_position_only():
    """A draw is a function of (seed, sequence, position): a row's d-th column equals the draw of
    that row's position + d asked alone, in any batch; draws are uniform on [0, 1) (chi-square
    over 64 bins) and change with each of the three keys."""
    u = acc.keyed_uniforms(7, [0, 5, 2], [0, 9, 4], 6)
    assert u.shape == (3, 6) and u.dtype == torch.float32
    for b, (seq, pos) in enumerate([(0, 0), (5, 9), (2, 4)]):
        for d in range(6):
            assert float(u[b, d]) == float(acc.keyed_uniforms(7, [seq], [pos + d], 1)[0, 0])
    many = acc.keyed_uniforms(3, list(range(2000)), [17] * 2000, 50).flatten()
    assert float(many.min()) >= 0.0 and float(many.max()) < 1.0
    observed = torch.bincount((many * 64).long(), minlength=64).double()
    expected = many.numel() / 64
    assert float(((observed - expected) ** 2 / expected).sum()) < bound(63)
    base = acc.keyed_uniforms(3, [4], [10], 8)
    for other in (acc.keyed_uniforms(4, [4], [10], 8), acc.keyed_uniforms(3, [5], [10], 8),
                  acc.keyed_uniforms(3, [4], [11], 8)[:, :7]):
        assert not torch.equal(base[:, : other.shape[1]], other)
    assert acc.keyed_uniforms(2**64 - 1, [0], [0], 1).shape == (1, 1)


def test_node_uniforms_give_each_node_its_depths_draw():
    """Node i + 1 reads column depth(i); the root column 0; padding reads depth 1's."""
    tree = DraftTree(torch.tensor([[4, 5, 6, 7, 0]]), torch.tensor([[-1, 0, -1, 1, -1]]), torch.tensor([4]))
    by_depth = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    assert acc.node_uniforms(tree, by_depth).tolist() == [[pytest.approx(x) for x in (0.1, 0.2, 0.3, 0.2, 0.4, 0.2)]]


@pytest.mark.parametrize("graphs", ["off", "unrecorded"])
def test_sampled_tokens_are_plain_decodings_whatever_budget_decides_them(graphs, monkeypatch):
    """Draws keyed by output position: plain decoding (no drafts), the fixed budget and an
    adaptive run whose steps cycle through the tree, its chain and plain decoding emit the same
    sampled tokens with the same seed, with drafts accepted along the way; another seed emits
    others (so the comparison can fail)."""
    from specla import SpecDecoder
    from specla.engine import Engine

    model = get_plugin("gdn").tiny_model("base", seed=3, dtype=torch.float32)
    prompts = [[5, 9, 5, 9, 5, 9, 2], [3, 14, 15, 9, 2, 6, 5, 3], [7, 1, 7, 1, 7]]
    base = dict(temperature=0.3, seed=7, max_new_tokens=16)
    drafts = dict(num_draft_tokens=6, max_depth=3, top_k=2)

    def run(policy="fixed", **config):
        config = dict(base, **config, engine=dict(cuda_graphs=graphs, budget_policy=policy))
        return SpecDecoder(model, "gdn", drafter="ngram", config=config).generate(prompts)

    plain = run(num_draft_tokens=0)
    fixed = run(**drafts)
    monkeypatch.setattr(Engine, "_choose", lambda self, batch: next(self.schedule) % len(self.configs))
    monkeypatch.setattr(Engine, "schedule", itertools.count(), raising=False)
    cycled = run("adaptive", **drafts)
    assert fixed.outputs == plain.outputs and cycled.outputs == plain.outputs
    assert sum(fixed.stats.accepted_histogram[1:]) > 0 and sum(cycled.stats.accepted_histogram[1:]) > 0
    assert cycled.stats.chain_steps > 0 and cycled.stats.plain_steps > 0
    assert run(**dict(drafts, seed=8)).outputs != plain.outputs


def test_a_sampling_graph_step_needs_its_draws():
    from specla import SpecDecoder
    from specla.cuda.graph_step import GraphRunner

    dec = SpecDecoder(get_plugin("gdn").tiny_model("base", seed=3, dtype=torch.float32), "gdn", drafter="ngram",
                      config=dict(temperature=0.5, num_draft_tokens=3, max_depth=3))
    runner = GraphRunner(dec.engine.adapter, dec.engine.drafter, dec.config, capture=False)
    dec.engine.adapter.prefill([[1, 2, 3]])
    for bad, got in ((None, "None"), (torch.rand(1, 3), "[1, 3]"), (torch.rand(2, 4), "[2, 4]")):
        with pytest.raises(ValueError, match=rf"a sampling step needs uniforms \[1, >= 4\], got {re.escape(got)}$"):
            runner.step([[1, 2, 3]], bad)


def test_an_unseeded_run_reports_the_seed_that_repeats_it():
    """A sampled run without a seed draws one and reports it in ``stats.seed``: passing it as the
    seed repeats the run's tokens; another unseeded run draws another; greedy runs report none."""
    from specla import SpecDecoder
    from specla.registry import get_plugin

    arch = get_plugin("gdn")
    model = arch.tiny_model("base", seed=4, dtype=torch.float32)
    prompts = [[3, 14, 15, 9, 2], [7, 1]]
    cfg = dict(temperature=1.0, max_new_tokens=12, num_draft_tokens=3, max_depth=3, device="cpu")
    first, second = (SpecDecoder(model, "gdn", drafter="ngram", config=cfg).generate(prompts) for _ in range(2))
    assert isinstance(first.stats.seed, int) and first.stats.seed != second.stats.seed
    again = SpecDecoder(model, "gdn", drafter="ngram", config={**cfg, "seed": first.stats.seed}).generate(prompts)
    assert again.outputs == first.outputs and again.stats.seed == first.stats.seed
    greedy = SpecDecoder(model, "gdn", drafter="ngram", config={**cfg, "temperature": 0.0}).generate(prompts)
    assert greedy.stats.seed is None
