"""Confidence-pruned best-first draft trees (specla/drafters/pruning.py)."""

import math

import pytest
import torch

from specla import DraftTree, SpecConfig
from specla.drafters.pruning import build_tree
from specla.ops.topk import log_softmax_topk

V = 6


def table(seed=0):
    """A fixed next-token log-probability table: the 'drafter' predicts from the last token only."""
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(V, V, generator=g) * 2, dim=-1)


def expand_with(logp_table, k):
    calls = []

    def expand(state, slot, tokens):
        """The state is the previous call's child tokens: each new node's token must be one of
        its parent's (row ``slot``) children."""
        calls.append(tokens.shape[1])
        if slot is None:
            assert state.shape[0] == tokens.shape[0] and tokens.shape[1] == 1
        else:
            assert (state.gather(1, slot[..., None].expand(-1, -1, state.shape[2])) == tokens[..., None]).any(-1).all()
        lp = logp_table[tokens]  # [B, M, V]: log-probabilities are their own logits
        return log_softmax_topk(lp, min(k, lp.shape[-1]))[1], lp  # the children, ties as the tree breaks them

    return expand, calls


def path_scores(tree, b, logp_table, root):
    scores = []
    for i in range(int(tree.num_nodes[b])):
        s, prev = 0.0, root
        for j in tree.path(b, i):
            tok = int(tree.tokens[b, j])
            s += float(logp_table[prev, tok])
            prev = tok
        scores.append(s)
    return scores


@pytest.mark.parametrize("N, D, k, tau", [(8, 4, 2, math.inf), (16, 5, 3, 2.0), (5, 5, 1, math.inf), (12, 3, 4, 0.5)])
def test_tree_respects_budget_depth_branching_and_threshold(N, D, k, tau):
    lp = table(N + D)
    roots = torch.tensor([0, 3, 5])
    expand, calls = expand_with(lp, k)
    tree = build_tree(expand, torch.zeros(3, 1), roots, SpecConfig(num_draft_tokens=N, max_depth=D, top_k=k, tau_tree=tau))
    assert isinstance(tree, DraftTree) and len(calls) == D and max(calls) <= k
    for b in range(3):
        n = int(tree.num_nodes[b])
        assert 1 <= n <= N
        par = tree.parents[b, :n].tolist()
        assert all(p < i for i, p in enumerate(par))  # topological
        assert int(tree.depth[b, :n].max()) <= D
        assert max(par.count(p) for p in set(par)) <= k  # at most top_k children per node
        scores = path_scores(tree, b, lp, int(roots[b]))
        best = max(scores)
        assert all(s >= best - tau - 1e-6 for s in scores)
        # the best root child (q*) is always kept
        assert best == pytest.approx(float(lp[int(roots[b])].max()), abs=1e-6)


def test_chain_mode_is_the_greedy_chain():
    lp = table(1)
    expand, _ = expand_with(lp, 1)
    tree = build_tree(expand, torch.zeros(1, 1), torch.tensor([2]), SpecConfig(num_draft_tokens=4, max_depth=4, top_k=1))
    prev, chain = 2, []
    for _ in range(4):
        prev = int(lp[prev].argmax())
        chain.append(prev)
    assert tree.tokens[0].tolist() == chain and tree.parents[0].tolist() == [-1, 0, 1, 2]


def test_best_nodes_are_kept_exhaustively_small_case():
    # k = V and D = 2: every depth-1 node is a candidate; the tree is the N best paths overall
    lp = table(2)
    expand, _ = expand_with(lp, V)
    cfg = SpecConfig(num_draft_tokens=7, max_depth=2, top_k=V)
    tree = build_tree(expand, torch.zeros(1, 1), torch.tensor([1]), cfg)
    got = sorted(path_scores(tree, 0, lp, 1), reverse=True)
    # all depth-1 scores plus depth-2 scores of the V best depth-1 nodes (every node is expanded)
    cands = [float(lp[1, a]) for a in range(V)] + [float(lp[1, a] + lp[a, c]) for a in range(V) for c in range(V)]
    assert got == pytest.approx(sorted(cands, reverse=True)[:7], abs=1e-6)


def test_tight_threshold_prunes_to_the_best_node():
    lp = table(3)
    expand, _ = expand_with(lp, 3)
    tree = build_tree(expand, torch.zeros(1, 1), torch.tensor([4]), SpecConfig(num_draft_tokens=8, max_depth=3, top_k=3, tau_tree=0.0))
    scores = path_scores(tree, 0, lp, 4)
    assert max(scores) - min(scores) <= 1e-6  # only nodes tied with the best survive


def test_zero_budget_gives_empty_trees():
    expand, calls = expand_with(table(), 2)
    tree = build_tree(expand, torch.zeros(2, 1), torch.tensor([0, 1]), SpecConfig(num_draft_tokens=0))
    assert tree.width == 0 and calls == []


def test_limit_depth_keeps_an_ancestor_closed_prefix():
    tree = DraftTree.from_lists([([1, 2, 3, 4, 5], [-1, 0, -1, 1, 2]), ([6, 7], [-1, 0])])
    cut = tree.limit_depth(torch.tensor([2, 0]))
    assert cut.tokens[0, :4].tolist() == [1, 2, 3, 5] and cut.parents[0, :4].tolist() == [-1, 0, -1, 2]
    assert cut.num_nodes.tolist() == [4, 0]
    assert tree.limit_depth(torch.tensor([9, 9])) is tree


def loop_select(score, token, parent, depth, budget, tau):
    """The per-sequence selection ``select_nodes`` replaced (one host loop per sequence): the
    oracle for the tensor version."""
    from specla.drafters.pruning import sorted_nodes

    keep = score >= score.max(1, keepdim=True).values - tau
    order = sorted_nodes(torch.where(keep, score, float("-inf")), depth)[:, :budget]
    trees = []
    for b in range(score.shape[0]):
        ranked = [int(i) for i in order[b] if bool(keep[b, i])]
        rank = {node: r for r, node in enumerate(ranked)}
        chosen = sorted(ranked, key=lambda i: (int(depth[b, i]), rank[i]))
        pos = {node: j for j, node in enumerate(chosen)}
        trees.append(([int(token[b, i]) for i in chosen],
                      [pos[int(parent[b, i])] if parent[b, i] >= 0 else -1 for i in chosen]))
    return DraftTree.from_lists(trees)


@pytest.mark.parametrize("seed", range(12))
def test_tensor_selection_equals_the_per_sequence_loop(seed, monkeypatch):
    """Random batches of best-first candidate sets (with tied scores) through ``build_tree``'s
    expansion: the tensor selection gives exactly the trees of the per-sequence loop."""
    from specla.drafters import pruning

    g = torch.Generator().manual_seed(seed)
    B, N, D, k = 5, int(torch.randint(1, 20, (1,), generator=g)), int(torch.randint(1, 6, (1,), generator=g)), \
        int(torch.randint(1, 5, (1,), generator=g))
    lp = torch.log_softmax(torch.randn(V, V, generator=g).round() * 2, dim=-1)  # rounding makes ties
    tau = [math.inf, 1.0, 0.0][seed % 3]
    captured = {}
    real = pruning.select_nodes

    def spy(*args):
        captured["args"] = args
        return real(*args)

    monkeypatch.setattr(pruning, "select_nodes", spy)
    tree = build_tree(expand_with(lp, k)[0], torch.zeros(B, 1), torch.randint(0, V, (B,), generator=g),
                      SpecConfig(num_draft_tokens=N, max_depth=D, top_k=k, tau_tree=tau))
    ref = loop_select(*captured["args"][:6])
    assert torch.equal(tree.num_nodes, ref.num_nodes)
    assert torch.equal(tree.tokens, ref.tokens) and torch.equal(tree.parents, ref.parents)
    # fixed width (what a CUDA graph records): the same trees, padded to min(N, candidates)
    fixed = real(*captured["args"][:6], True)
    w = tree.width
    assert fixed.width == min(N, captured["args"][0].shape[1])
    assert torch.equal(fixed.num_nodes, ref.num_nodes)
    assert torch.equal(fixed.tokens[:, :w], ref.tokens) and torch.equal(fixed.parents[:, :w], ref.parents)
    assert (fixed.tokens[:, w:] == 0).all() and (fixed.parents[:, w:] == -1).all()


def test_sampled_tree_draws_children_from_q_and_keeps_its_shape_fixed():
    """``sample_tree``: every node's token is drawn from its parent's row of ``q`` (attached as
    ``draft_probs``), the shape (node count, parents' slots) is the same in every sequence and
    every run, nodes come parents first, and a seeded generator repeats the draws."""
    from specla.drafters.pruning import sample_tree

    q_table = torch.softmax(torch.randn(V, V, generator=torch.Generator().manual_seed(3)), -1)

    def step(state, slot, tokens):
        return state, q_table[tokens]

    cfg = SpecConfig(num_draft_tokens=11, max_depth=4, top_k=3)
    roots = torch.tensor([0, 2, 5, 5])
    trees = [sample_tree(step, torch.zeros(4, 1), roots, cfg, torch.Generator().manual_seed(9)) for _ in range(2)]
    t = trees[0]
    assert torch.equal(t.tokens, trees[1].tokens) and torch.equal(t.parents, trees[1].parents)
    assert t.num_nodes.tolist() == [11] * 4  # levels of ceil(11 / 4) = 3, 3, 3, then the 2 left: depth 4
    for lo, hi, plo, phi in ((0, 3, -1, -1), (3, 6, 0, 2), (6, 9, 3, 5), (9, 11, 6, 8)):
        assert (t.parents[:, lo:hi] >= plo).all() and (t.parents[:, lo:hi] <= phi).all()
    for b in range(4):
        for i in range(11):
            par = int(t.parents[b, i])
            prev = int(roots[b]) if par < 0 else int(t.tokens[b, par])
            assert torch.equal(t.draft_probs[b, i], q_table[prev])
            assert q_table[prev, t.tokens[b, i]] > 0
    cut = t.limit_depth(torch.tensor([1, 2, 2, 0]))  # draft_probs follow the kept nodes
    assert cut.num_nodes.tolist() == [3, 6, 6, 0]
    assert torch.equal(cut.draft_probs[0, :3], t.draft_probs[0, :3])
    assert torch.equal(cut.draft_probs[1, :6], t.draft_probs[1, :6])


def test_draft_probs_shape_is_checked():
    from specla.errors import InvalidTreeError

    with pytest.raises(InvalidTreeError, match="draft_probs"):
        DraftTree(torch.zeros(1, 2, dtype=torch.int64), torch.tensor([[-1, 0]]), torch.tensor([2]), torch.rand(1, 3, 5))


def test_top_k_wider_than_the_vocabulary_is_capped():
    """A drafter whose vocabulary is narrower than ``top_k`` returns fewer children per node."""
    small = torch.log_softmax(torch.randn(3, 3, generator=torch.Generator().manual_seed(1)), -1)
    tree = build_tree(expand_with(small, 3)[0], torch.zeros(2, 1), torch.tensor([0, 2]),
                      SpecConfig(num_draft_tokens=8, max_depth=3, top_k=5))
    tree.validate(vocab_size=3, max_nodes=8, max_depth=3)
    assert tree.num_nodes.tolist() == [8, 8]
