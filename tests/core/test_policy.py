"""The budget policy (specla.policy): the choice between the configured draft budget and plain
decoding from measured step times and acceptance, and the engine's switches between them."""

from pathlib import Path

import pytest
import torch

import specla
from specla.api import SpecDecoder
from specla.config import SpecConfig
from specla.policy import BudgetPolicy, resolve_budget_policy
from specla.registry import get_plugin

ADAPTIVE = dict(budget_policy="adaptive")  # the engine options of an adaptive run


def drive(policy, batch, seconds, tokens, steps):
    """Run ``steps`` steps where candidate ``c`` takes ``seconds[c]`` and commits ``tokens[c]``
    tokens per sequence; returns the candidates chosen."""
    chosen = []
    for _ in range(steps):
        c = policy.choose(batch)
        chosen.append(c)
        policy.observe(batch, seconds[c], tokens[c])
    return chosen


def test_each_candidate_is_measured_then_the_faster_rate_runs():
    p = BudgetPolicy([8, 0], warmup=2, window=4, reprobe=1000)
    # speculation: 3 tokens in 2.5 ms (1.2 tokens/ms); plain: 1 token in 1 ms
    chosen = drive(p, 1, {0: 2.5e-3, 1: 1e-3}, {0: 3.0, 1: 1.0}, 40)
    assert chosen[:6] == [0] * 6 and chosen[6:12] == [1] * 6  # warm-up + window for each
    assert set(chosen[12:]) == {0}
    assert p.rate(1, 0) == pytest.approx(3 / 2.5e-3) and p.rate(1, 1) == pytest.approx(1 / 1e-3)
    # at batch 64 the verify is compute-bound: 3 tokens in 4 ms lose to 1 token in 1.2 ms
    chosen = drive(BudgetPolicy([8, 0], warmup=2, window=4, reprobe=1000), 64, {0: 4e-3, 1: 1.2e-3},
                   {0: 3.0, 1: 1.0}, 40)
    assert set(chosen[12:]) == {1}


def test_a_new_batch_size_runs_the_nearest_choice_then_measures_its_own():
    """Rows finishing shrink the batch: the new batch size runs the choice of the nearest measured
    one, measures the candidate it runs as it goes, and the others one per ``reprobe`` steps;
    then its own fastest rate runs. Batch sizes are kept apart."""
    p = BudgetPolicy([8, 0], warmup=1, window=2, reprobe=20)
    fast, slow = ({0: 2.5e-3, 1: 1e-3}, {0: 3.0, 1: 1.0}), ({0: 4e-3, 1: 1.2e-3}, {0: 3.0, 1: 1.0})
    assert drive(p, 32, *slow, 20) == [0] * 3 + [1] * 17  # nothing measured yet: measured at once
    chosen = drive(p, 16, *fast, 40)  # at 16 speculation wins, but 16 starts with 32's choice
    assert chosen[:20] == [1] * 20 and chosen[20:] == [0] * 20
    assert p.rate(16, 0) == pytest.approx(3 / 2.5e-3) and p.rate(16, 1) == pytest.approx(1 / 1e-3)
    assert drive(p, 4, *fast, 6) == [0] * 3 + [1] * 3  # no measured neighbour (2 or 8): measured at once


def test_a_borrowed_choice_gives_way_to_a_faster_own_measurement():
    """Batch 16 starts with batch 32's choice (plain decoding) while the tree is its fastest: once a
    reprobe has measured the tree at 16, the tree runs there, before the chain is measured."""
    p = BudgetPolicy([15, 6, 0], warmup=1, window=2, reprobe=20)
    tokens = {0: 5.0, 1: 4.0, 2: 1.0}
    drive(p, 32, {0: 9e-3, 1: 7e-3, 2: 1.2e-3}, tokens, 15)  # plain wins at 32
    chosen = drive(p, 16, {0: 1.8e-3, 1: 1.7e-3, 2: 0.7e-3}, tokens, 40)
    assert chosen[:20] == [2] * 20 and chosen[20:23] == [0] * 3 and chosen[23:40] == [0] * 17
    assert p.rate(16, 1) is None  # the chain waits for the next reprobe


def test_the_other_candidate_is_remeasured_every_reprobe_steps():
    p = BudgetPolicy([8, 0], warmup=1, window=2, reprobe=10)
    seconds, tokens = {0: 3e-3, 1: 1e-3}, {0: 1.5, 1: 1.0}  # a poor drafter: plain decoding wins
    chosen = drive(p, 4, seconds, tokens, 6)
    assert chosen == [0, 0, 0, 1, 1, 1]
    chosen = drive(p, 4, seconds, tokens, 30)
    probes = [i for i in range(1, len(chosen)) if chosen[i] == 0 and chosen[i - 1] == 1]
    assert len(probes) >= 2 and all(chosen[i : i + 3] == [0, 0, 0] for i in probes)
    tokens[0] = 6.0  # the text turned repetitive: the drafter now pays, and the next probe sees it
    chosen = drive(p, 4, seconds, tokens, 40)
    assert chosen[-20:] == [0] * 20


def test_the_chain_candidate_wins_where_the_tree_is_too_dear():
    """Three candidates (tree, its chain, plain): at batch 1 the tree's extra acceptance pays; at
    batch 32 a compute-bound tree verify costs more than it gains and the chain wins; at batch 64
    plain decoding does."""
    tokens = {0: 5.4, 1: 4.6, 2: 1.0}
    for batch, seconds, best in ((1, {0: 1.8e-3, 1: 1.7e-3, 2: 0.7e-3}, 0),
                                 (32, {0: 2.9e-3, 1: 2.0e-3, 2: 0.9e-3}, 1),
                                 (64, {0: 9.0e-3, 1: 7.0e-3, 2: 1.2e-3}, 2)):
        chosen = drive(BudgetPolicy([15, 6, 0], warmup=1, window=2, reprobe=1000), batch, seconds, tokens, 30)
        assert chosen[:9] == [0, 0, 0, 1, 1, 1, 2, 2, 2]  # each measured: warm-up + window
        assert set(chosen[9:]) == {best}, batch


def test_every_drafting_candidate_is_remeasured_in_turn():
    """Plain decoding runs while the tree (0.9x) and the chain (0.75x) lose to it; then the text
    turns easy for the chain (2x): the reprobes take the drafting candidates in turn, so the chain
    is measured again and takes over, though the tree ranked above it."""
    p = BudgetPolicy([15, 6, 0], warmup=1, window=2, reprobe=20)
    seconds, tokens = {0: 3e-3, 1: 2e-3, 2: 1e-3}, {0: 2.7, 1: 1.5, 2: 1.0}
    assert set(drive(p, 32, seconds, tokens, 60)[9:]) >= {2}
    tokens[1] = 4.0
    tail = drive(p, 32, seconds, tokens, 100)[-60:]
    assert tail.count(1) >= 50 and 2 not in tail  # the chain runs, the tree is reprobed now and then


def test_untimed_and_warmup_steps_do_not_count():
    p = BudgetPolicy([4, 0], warmup=2, window=1, reprobe=100)
    for seconds in (9.0, 9.0, None, 2e-3):  # two warm-up steps, an untimed one, then one timed
        assert p.choose(1) == 0
        p.observe(1, seconds, 2.0)
    assert p.rate(1, 0) == pytest.approx(2.0 / 2e-3)
    with pytest.raises(ValueError, match="window >= 1"):
        BudgetPolicy([4, 0], window=0)


class _Scripted(BudgetPolicy):
    """Chooses the candidates of a fixed script, over and over (observations are ignored)."""

    def __init__(self, script):
        super().__init__([4, 3, 0])
        self.script, self.i = script, 0

    def choose(self, batch):
        self.i += 1
        return self.script[(self.i - 1) % len(self.script)]

    def observe(self, batch, seconds, tokens):
        pass


@pytest.mark.parametrize("graphs", ["off", "unrecorded", pytest.param(
    "on", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))])
@pytest.mark.parametrize("commit", ["factor", "snapshot"])
def test_switching_budgets_between_steps_keeps_the_output_exact(graphs, commit):
    """Steps switching between the configured tree budget, its chain and plain decoding in an
    irregular pattern (pending commits of one budget applied by another's verify; with graphs,
    each switch flushes and the other budget's graphs take the state), with sequences ending at
    different steps: outputs equal sequential greedy decoding; the plain and chain steps, the
    switches and the recorded graphs are counted."""
    arch = get_plugin("gdn")
    model = arch.tiny_model("base", seed=3, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    motif = torch.randint(0, 61, (4,), generator=g).tolist()
    prompts = [motif * 3, torch.randint(0, 61, (7,), generator=g).tolist(), [motif[0]], motif * 2 + [5], [9, 9]]
    refs = [arch.reference_decode(model, p, 20) for p in prompts]
    stops = tuple(sorted({r[j] for r, j in zip(refs, (2, 9))}))
    ends = [min([r.index(t) + 1 for t in stops if t in r] + [20]) for r in refs]
    cfg = dict(num_draft_tokens=4, max_depth=3, top_k=2, max_new_tokens=20, stop_token_ids=stops,
               engine=dict(ADAPTIVE, commit=commit, cuda_graphs=graphs),
               device="cuda" if graphs == "on" else "cpu")
    dec = SpecDecoder(model, config=cfg)
    assert [(c.num_draft_tokens, c.top_k) for c in dec.engine.configs] == [(4, 2), (3, 1), (0, 2)]
    dec.engine.policy = _Scripted([0, 0, 2, 1, 0, 2, 2, 1, 1, 2, 0])
    out = dec.generate(prompts)
    assert out.outputs == [r[:e] for r, e in zip(refs, ends)]
    script = dec.engine.policy.script
    choices = [0] + [script[i % len(script)] for i in range(out.stats.steps)]  # the engine starts on budget 0
    assert out.stats.plain_steps == choices[1:].count(2) > 0
    assert out.stats.chain_steps == choices[1:].count(1) > 0
    assert out.stats.budget_switches == sum(a != b for a, b in zip(choices, choices[1:]))
    assert (out.stats.switch_s > 0) == (graphs != "off")  # only graph runs pay for a switch
    # recorded only on a GPU: each budget's graph per batch size it meets, once
    assert (out.stats.graphs_recorded >= 2) == (graphs == "on")
    dec.engine.policy.i = 0  # the same choices again, so the same budgets meet the same batch sizes
    again = dec.generate(prompts)
    assert again.outputs == out.outputs
    assert again.stats.graphs_recorded == 0  # the graphs of every budget are reused


@pytest.mark.parametrize("graphs", ["unrecorded", pytest.param(
    "on", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))])
def test_switching_with_the_eagle_drafter_keeps_the_output_exact(graphs):
    """The trained tiny EAGLE drafter's device trees under a script of tree, chain and plain
    steps (the drafter's cache follows every committed token, whichever candidate committed it):
    outputs equal plain decoding's."""
    assets = Path(__file__).resolve().parents[2] / "plugins" / "fla" / "assets"
    prompts = [[5, 17, 3, 9, 12, 40, 2], [8, 8, 30], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
    cfg = dict(max_new_tokens=24, device="cuda" if graphs == "on" else "cpu", stop_at_eos=False)
    ar = SpecDecoder(assets / "tiny", drafter="ngram", config=dict(cfg, num_draft_tokens=0)).generate(prompts)
    dec = SpecDecoder(assets / "tiny", drafter=str(assets / "tiny-eagle"), config=dict(
        cfg, num_draft_tokens=6, max_depth=4, top_k=2, engine=dict(ADAPTIVE, cuda_graphs=graphs)))
    dec.engine.policy = _Scripted([1, 0, 2, 1, 1, 0, 0, 2])
    out = dec.generate(prompts)
    assert out.outputs == ar.outputs
    assert out.stats.chain_steps > 0 and out.stats.plain_steps > 0
    assert sum(out.stats.accepted_histogram[1:]) > 0  # the drafter's trees were accepted in part


@pytest.mark.parametrize("config, recorded, want", [
    (dict(), True, "adaptive"), (dict(), False, "fixed"),
    (dict(temperature=0.7), True, "adaptive"), (dict(temperature=0.7, seed=3), True, "fixed"),
    (dict(num_draft_tokens=0), True, "fixed"), (dict(engine=ADAPTIVE, num_draft_tokens=0), True, "fixed"),
    (dict(engine=dict(budget_policy="fixed")), True, "fixed"), (dict(engine=ADAPTIVE), False, "adaptive"),
    (dict(engine=ADAPTIVE, temperature=0.7, seed=3), False, "adaptive")])
def test_auto_is_adaptive_for_recorded_steps_without_seeded_sampling(config, recorded, want):
    assert resolve_budget_policy(SpecConfig(**config), recorded) == want


def test_the_policy_defaults_to_fixed_budgets_on_eager_steps():
    model = get_plugin("gdn").tiny_model("base", seed=3, dtype=torch.float32)
    assert SpecDecoder(model, config=dict(device="cpu")).engine.policy is None
    assert SpecDecoder(model, config=dict(device="cpu", engine=dict(cuda_graphs="unrecorded"))).engine.policy is None
    assert SpecDecoder(model, config=dict(engine=ADAPTIVE)).engine.policy is not None
    assert SpecDecoder(model, config=dict(engine=ADAPTIVE, num_draft_tokens=0)).engine.policy is None
    # a chain's candidates are itself and plain decoding; a tree's add its chain, as deep as the tree
    chain = SpecDecoder(model, config=dict(engine=ADAPTIVE, num_draft_tokens=6, max_depth=6, top_k=1))
    assert chain.engine.policy.budgets == [6, 0]
    tree = SpecDecoder(model, config=dict(engine=ADAPTIVE, num_draft_tokens=15, max_depth=6, top_k=4))
    assert tree.engine.policy.budgets == [15, 6, 0]
    assert (tree.engine.configs[1].top_k, tree.engine.configs[1].max_depth) == (1, 6)
    if torch.cuda.is_available():  # recorded steps: adaptive by default, fixed when the graphs are off
        assert SpecDecoder(model, config=dict(device="cuda")).engine.policy is not None
        assert SpecDecoder(model, config=dict(device="cuda", engine=dict(cuda_graphs="off"))).engine.policy is None
    out = specla.run(model, prompts=[[1, 2, 3]], config=dict(engine=ADAPTIVE, max_new_tokens=30))
    assert out.outputs == [get_plugin("gdn").reference_decode(model, [1, 2, 3], 30)]


@pytest.mark.parametrize("graphs", ["unrecorded", pytest.param(
    "on", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))])
def test_warm_up_prepares_every_candidates_graphs_and_leaves_the_output_exact(graphs):
    """``SpecDecoder.warm_up`` under the adaptive policy: every candidate budget (tree, its
    chain, plain) gets its graph for the batch and for the smaller graph batch its finishing rows
    gather into, the policy observes none of the forced steps (its first measurements come from
    the last, policy-chosen pass), and a later call decodes exactly and, on a GPU, records no
    graph; a bad prompt raises as generate does."""
    from specla.errors import InvalidTokenError

    arch = get_plugin("gdn")
    model = arch.tiny_model("base", seed=3, dtype=torch.float32)
    g = torch.Generator().manual_seed(2)
    motif = torch.randint(0, 61, (4,), generator=g).tolist()
    prompts = [motif * 3, torch.randint(0, 61, (7,), generator=g).tolist(), motif * 2 + [5], [9, 9]]
    refs = [arch.reference_decode(model, p, 16) for p in prompts]
    stops = (refs[1][1], refs[3][3])  # rows end at different steps: the rest gather into smaller batches
    ends = [min([r.index(t) + 1 for t in stops if t in r] + [16]) for r in refs]
    assert len(set(ends)) >= 3
    dec = SpecDecoder(model, config=dict(num_draft_tokens=4, max_depth=3, top_k=2, max_new_tokens=16,
                                         stop_token_ids=stops, engine=dict(cuda_graphs=graphs, **ADAPTIVE),
                                         device="cuda" if graphs == "on" else "cpu"))
    eng = dec.engine
    with pytest.raises(InvalidTokenError):
        dec.warm_up([[1, 2], []])
    assert all(r is None or not r.graphs for r in eng._graph_runners)
    observed = []
    eng.policy.observe = lambda *a, _f=eng.policy.observe: (observed.append(eng._forced), _f(*a))
    dec.warm_up(prompts)
    assert observed and set(observed) == {None}  # the forced steps were not observed
    for runner in eng._graph_runners:  # each candidate's graph for 4 rows and a smaller batch
        assert runner is not None and 4 in runner.graphs and len(runner.graphs) >= 2
    out = dec.generate(prompts)
    assert out.outputs == [r[:e] for r, e in zip(refs, ends)]
    assert out.stats.graphs_recorded == 0
