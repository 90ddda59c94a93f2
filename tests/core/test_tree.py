import math
import random

import pytest
import torch

from specla import BudgetError, DraftTree, InvalidTokenError, InvalidTreeError
from specla.tree import heavy_light_chains, inclusive_ancestor_mask


def random_parents(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(-1, i) for i in range(n)]


def test_masks_depths_and_paths_match_parent_walks(rng):
    for _ in range(20):
        n = rng.randrange(1, 12)
        par = random_parents(n, rng)
        tree = DraftTree.from_lists([(list(range(n)), par)])
        for i in range(n):
            path = tree.path(0, i)
            assert path[-1] == i and all(tree.parents[0, path[j + 1]] == path[j] for j in range(len(path) - 1))
            assert tree.parents[0, path[0]] == -1
            expect = torch.zeros(n, dtype=torch.bool)
            expect[path] = True
            assert torch.equal(tree.ancestor_mask[0, i], expect)
            assert int(tree.depth[0, i]) == len(path)
        assert not tree.strict_ancestor_mask[0].diagonal().any()
        assert torch.equal(tree.strict_ancestor_mask[0] | torch.eye(n, dtype=torch.bool), tree.ancestor_mask[0])


def test_parents_with_root_shift():
    tree = DraftTree.from_lists([([5, 6, 7], [-1, 0, 0])])
    assert tree.parents_with_root.tolist() == [[-1, 0, 1, 1]]
    assert inclusive_ancestor_mask(tree.parents_with_root)[0, 3].tolist() == [True, True, False, True]


def test_padding_is_canonical_and_placeholders_never_survive():
    tree = DraftTree(
        torch.tensor([[4, -100, -1], [1, 2, 3]]),
        torch.tensor([[-1, 0, 7], [-1, 0, 1]]),
        torch.tensor([1, 3]),
    )
    assert tree.tokens.tolist() == [[4, 0, 0], [1, 2, 3]]
    assert tree.parents.tolist() == [[-1, -1, -1], [-1, 0, 1]]
    assert tree.valid.tolist() == [[True, False, False], [True, True, True]]


@pytest.mark.parametrize(
    "parents, match",
    [([-1, 1], "parent 1 is not in -1..0"), ([-1, 0, 2], "parent 2 is not in -1..1"), ([0], "parent 0"),
     ([-1, -2], "parent -2")],
)
def test_invalid_structure_is_rejected(parents, match):
    with pytest.raises(InvalidTreeError, match=match):
        DraftTree.from_lists([(list(range(len(parents))), parents)])


def test_invalid_shapes_dtypes_counts():
    with pytest.raises(InvalidTreeError, match="shapes"):
        DraftTree(torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, 4, dtype=torch.int64), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(InvalidTreeError, match="tokens must be int64"):
        DraftTree(torch.zeros(1, 1, dtype=torch.int32), torch.full((1, 1), -1), torch.ones(1, dtype=torch.int64))
    with pytest.raises(InvalidTreeError, match="num_nodes must lie in 0..1"):
        DraftTree(torch.zeros(1, 1, dtype=torch.int64), torch.full((1, 1), -1), torch.tensor([2]))
    with pytest.raises(InvalidTreeError, match="3 tokens but 2 parents"):
        DraftTree.from_lists([([1, 2, 3], [-1, 0])])


def test_validate_budget_depth_and_vocabulary():
    tree = DraftTree.from_lists([([1, 2, 3], [-1, 0, 1]), ([4], [-1])])
    tree.validate(vocab_size=10, max_nodes=3, max_depth=3)
    with pytest.raises(BudgetError, match="3 nodes, over the budget N=2"):
        tree.validate(vocab_size=10, max_nodes=2, max_depth=3)
    with pytest.raises(BudgetError, match="depth 3 exceeds max_depth=2"):
        tree.validate(vocab_size=10, max_nodes=3, max_depth=2)
    with pytest.raises(InvalidTokenError, match="token id 4 is outside the vocabulary 0..3"):
        tree.validate(vocab_size=4, max_nodes=3, max_depth=3)
    neg = DraftTree.from_lists([([1, -1], [-1, 0])])
    with pytest.raises(InvalidTokenError, match="token id -1"):
        neg.validate(vocab_size=4, max_nodes=3, max_depth=3)


def test_heavy_light_decomposition_properties(rng):
    for _ in range(50):
        n = rng.randrange(1, 40)
        par = random_parents(n, rng)
        chains = heavy_light_chains(par)
        seen = sorted(i for c in chains for i in c.nodes)
        assert seen == list(range(n))  # every node in exactly one chain
        wave_of = {}
        for c in chains:
            assert par[c.nodes[0]] == c.parent
            assert all(par[c.nodes[j + 1]] == c.nodes[j] for j in range(len(c.nodes) - 1))
            expected_wave = 0 if c.parent < 0 else wave_of[c.parent] + 1  # parent chain came first
            assert c.wave == expected_wave
            for node in c.nodes:
                wave_of[node] = c.wave
        # each light edge at least halves the subtree: waves <= log2(n) + 1
        assert max(c.wave for c in chains) <= math.log2(n) + 1


def test_heavy_light_on_known_tree():
    # 0 -> {1, 2}, 1 -> {3, 4}, 3 -> 5 ; 6 is a second root child
    par = [-1, 0, 0, 1, 1, 3, -1]
    chains = heavy_light_chains(par)
    assert [(c.nodes, c.parent, c.wave) for c in chains] == [
        ((0, 1, 3, 5), -1, 0), ((6,), -1, 0), ((2,), 0, 1), ((4,), 1, 1)
    ]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 16, 17, 64, 65])
def test_ancestor_mask_of_long_chains_and_mixed_batches(n):
    """Chains as deep as the largest budgets (the closure needs every squaring), batched with a
    star of the same width: exact masks."""
    chain = torch.arange(-1, n - 1)
    star = torch.tensor([-1] + [0] * (n - 1))
    mask = inclusive_ancestor_mask(torch.stack([chain, star]))
    assert torch.equal(mask[0], torch.ones(n, n, dtype=torch.bool).tril())
    expect = torch.eye(n, dtype=torch.bool)
    expect[:, 0] = True
    assert torch.equal(mask[1], expect)
