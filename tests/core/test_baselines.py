"""The research baselines (specla.baselines): every bundled mixer declares both, so the
conformance suite runs them for every bundled plugin; a model with a mixer that declares none
refuses them with a ConfigError naming it; the generic snapshot record holds, per state tensor,
exactly the factor commit's state at every node; the generic records select, count and commit
their tuple fields."""

import pytest
import torch

import specla
from specla.baselines import BASELINES, ReplayRecord, SnapshotRecord
from specla.config import SpecConfig
from specla.errors import ConfigError
from specla.records import PendingCommit
from specla.registry import get_plugin
from specla.testing.diagnosis import state_tolerance
from specla.tree import DraftTree

BUNDLED = ["gdn", "gla", "mamba2", "qwen", "lfm2", "kimi_linear", "mamba2_hybrid"]


@pytest.mark.parametrize("plugin", BUNDLED)
def test_every_bundled_mixer_declares_both_baselines(plugin):
    arch = get_plugin(plugin)
    for variant in arch.tiny_variants:
        for m in arch.make_adapter(arch.tiny_model(variant), SpecConfig()).mixers:
            assert m.baselines == frozenset(BASELINES), (variant, type(m).__name__)


@pytest.mark.parametrize("commit", BASELINES)
def test_a_mixer_without_the_baseline_refuses_it_with_a_config_error_naming_it(commit):
    """The retention example's mixer declares no baseline: its hybrid variant (retention,
    attention, retention) is refused at its first mixer, through make_adapter and specla.run."""
    arch = get_plugin("retention")
    model = arch.tiny_model("hybrid")
    want = (f"commit={commit!r}: mixer 0 of 3 (RetentionMixer) does not run the {commit} baseline (it declares "
            "none); every model runs commit='factor'")
    with pytest.raises(ConfigError) as err:
        arch.make_adapter(model, SpecConfig(engine={"commit": commit}))
    assert str(err.value) == want
    with pytest.raises(ConfigError) as err:
        specla.run(model, "retention", prompts=[[1, 2, 3]], config=dict(engine={"commit": commit}, max_new_tokens=2))
    assert str(err.value) == want
    assert specla.run(model, "retention", prompts=[[1, 2, 3]], config=dict(max_new_tokens=2)).outputs[0]


@pytest.mark.parametrize("plugin", BUNDLED)
def test_snapshot_states_are_the_factor_commit_of_every_node(plugin):
    """A snapshot pass's record of each mixer holds, for every node of a tree, each state tensor
    as the factor commit of that node's root path leaves it (attention keeps its KV record)."""
    arch = get_plugin(plugin)
    model = arch.tiny_model(arch.tiny_variants[0])
    prompt = [3, 1, 4, 1, 5]
    tree = DraftTree.from_lists([([2, 7, 1, 8], [-1, 0, 0, 2])])
    snap = arch.make_adapter(model, SpecConfig(engine={"commit": "snapshot"}))
    snap.prefill([prompt])
    records = snap.verify(tree).records
    assert any(isinstance(r, SnapshotRecord) for r in records)
    tol = state_tolerance(arch, snap.dtype)
    for node in range(5):  # root-explicit: node 0 is the root
        nodes = [0] + [j + 1 for j in tree.path(0, node - 1)] if node else [0]
        factor = arch.make_adapter(model, SpecConfig())
        factor.prefill([prompt])
        out = factor.verify(tree)
        factor._apply(PendingCommit.from_records(out.records, torch.tensor([nodes]), torch.tensor([len(nodes)])))
        for i, (m, rec) in enumerate(zip(factor.mixers, records)):
            if not isinstance(rec, SnapshotRecord):
                continue
            assert len(rec.states) == len(m.state())
            for name, got, want in zip(m.state_names(), rec.states, m.state()):
                assert got.dtype == want.dtype and got.shape == (1, 5, *want.shape[1:])
                assert torch.allclose(got[0, node], want[0], rtol=tol, atol=tol), (i, name, node)


def test_generic_records_select_count_and_commit_their_tuple_fields():
    S = torch.randn(3, 5, 2, 2, dtype=torch.float64)  # [B, T, ...] per node
    win = torch.randn(3, 5, 1, 4)
    rec = SnapshotRecord((S, win))
    picked = rec.select(torch.tensor([2, 0]))
    assert torch.equal(picked.states[0], S[[2, 0]]) and torch.equal(picked.states[1], win[[2, 0]])
    assert rec.tensors() == [S, win]
    assert rec.nbytes_per_sequence() == 5 * 4 * 8 + 5 * 4 * 4
    replay = ReplayRecord((S, win), None)
    assert replay.tensors() == [S, win] and replay.select(torch.tensor([1])).conv_x is None

    class Held:  # the state interface SnapshotRecord.commit uses
        def __init__(self):
            self.tensors = [torch.randn(3, 2, 2, dtype=torch.float64), torch.randn(3, 1, 4)]

        def state(self):
            return self.tensors

        def set_state(self, it):
            self.tensors = [next(it), next(it)]

    held = Held()
    before = [t.clone() for t in held.tensors]
    path = torch.tensor([[0, 2, -1], [0, -1, -1], [0, 1, 4]])
    rec.commit(held, path, torch.tensor([2, 0, 3]))
    assert torch.equal(held.tensors[0][0], S[0, 2]) and torch.equal(held.tensors[1][2], win[2, 4])
    assert all(torch.equal(t[1], b[1]) for t, b in zip(held.tensors, before))  # path_len 0: bit-identical
