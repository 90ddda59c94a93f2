"""Property-based fuzzing (hypothesis) of tree shapes, budgets and acceptance patterns against
plain sequential decoding; failures shrink to a minimal tree. Bounded example counts for CI."""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specla import DraftTree, Drafter, SpecConfig, SpecDecoder
from specla_gdn.naive import naive_greedy_decode
from conftest import make_model

MODEL = make_model("gva")  # float64: exact comparisons
V = MODEL.config.vocab_size
NEW = 10


class ScriptedDrafter(Drafter):
    """Replays drafted trees from a script: per step, per sequence, a list of (parent, token or
    'right'/'wrong'), where 'right' drafts the reference continuation along the node's path."""

    name = "scripted"

    def __init__(self, prompts, refs, script):
        self.prompts, self.refs, self.script = prompts, refs, script
        self.active, self.step = list(range(len(prompts))), 0

    def reset(self, prompts):
        self.active, self.step = list(range(len(prompts))), 0

    def select(self, index):
        self.active = [self.active[i] for i in index.tolist()]

    def propose(self, contexts, config):
        trees = []
        for seq, ctx in zip(self.active, contexts):
            spec = self.script[(self.step + seq) % len(self.script)]
            pos = len(ctx) - len(self.prompts[seq])
            tokens, parents, depth = [], [], []
            for parent, kind in spec:
                parent = parent if parent < len(tokens) else -1
                d = 1 if parent < 0 else depth[parent] + 1
                ref = self.refs[seq][pos + d - 1] if pos + d - 1 < len(self.refs[seq]) else 0
                tokens.append(ref if kind == "right" else (ref + 1 + kind) % V if isinstance(kind, int) else (ref + 1) % V)
                parents.append(parent)
                depth.append(d)
            keep = [i for i in range(len(tokens)) if depth[i] <= config.max_depth][: config.num_draft_tokens]
            keep = [i for i in keep if parents[i] < 0 or parents[i] in keep]  # stay ancestor-closed
            pos_of = {i: j for j, i in enumerate(keep)}
            trees.append(([tokens[i] for i in keep], [pos_of[parents[i]] if parents[i] >= 0 else -1 for i in keep]))
        self.step += 1
        return DraftTree.from_lists(trees)


node = st.tuples(st.integers(-1, 7), st.one_of(st.just("right"), st.just("wrong"), st.integers(0, 3)))
steps = st.lists(st.lists(node, min_size=0, max_size=8), min_size=1, max_size=4)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(script=steps, lengths=st.lists(st.integers(1, 9), min_size=1, max_size=3),
       commit=st.sampled_from(["factor", "snapshot", "replay"]), budget=st.integers(0, 8), depth=st.integers(1, 6),
       seed=st.integers(0, 1000))
def test_random_trees_and_acceptance_match_sequential(script, lengths, commit, budget, depth, seed):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in lengths]
    refs = [naive_greedy_decode(MODEL, p, NEW + 8) for p in prompts]
    drafter = ScriptedDrafter(prompts, refs, script)
    cfg = SpecConfig(num_draft_tokens=budget, max_depth=depth, max_new_tokens=NEW, commit=commit)
    result = SpecDecoder(MODEL, "gdn", drafter=drafter, config=cfg).generate(prompts)
    assert result.outputs == [r[:NEW] for r in refs]
