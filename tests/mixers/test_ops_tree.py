"""The ancestor-mask kernel (``specla.ops.tree_triton``) and the tree kernels' in-register mask
(``ancestor_mask_tile``, from one parent per node) against their PyTorch twin
(``specla.tree.inclusive_ancestor_mask``) on random trees of every shape (under
``TRITON_INTERPRET=1`` on the CPU, compiled on a GPU)."""

import random

import pytest
import torch
import triton
import triton.language as tl

from specla.ops import tree_triton
from specla.ops.tree_triton import ancestor_mask_tile
from specla.tree import inclusive_ancestor_mask
from trees import DEV, SHAPES, batch_parents


@pytest.mark.parametrize("kind", SHAPES)
@pytest.mark.parametrize("sizes", [[1, 1], [16, 9, 3], [64, 40]])
def test_kernel_equals_twin(kind, sizes):
    """Outputs pre-filled (every mask entry True, depths -7) so that an unwritten one fails."""
    parents = batch_parents(kind, sizes, random.Random(len(kind) + sum(sizes))).to(DEV)
    B, T = parents.shape
    out = (torch.ones(B, T, T, dtype=torch.bool, device=DEV), torch.full((B, T), -7, device=DEV))
    mask, depth = tree_triton.ancestor_mask(parents, out=out)
    ref = inclusive_ancestor_mask(parents)
    assert mask is out[0] and depth is out[1]
    assert torch.equal(mask, ref)
    assert torch.equal(depth, ref.sum(-1) - 1)


@triton.jit
def _mask_tile_kernel(parents, sizes, out, T, BT: tl.constexpr, ANC: tl.constexpr):
    """Tree ``b``'s ``ancestor_mask_tile`` (its first ``sizes[b]`` nodes) into ``out [B, BT, BT]``."""
    i_b = tl.program_id(0)
    o_t = tl.arange(0, BT)
    b_M = ancestor_mask_tile(parents, parents, i_b, T, T, o_t, o_t < tl.load(sizes + i_b), ANC)
    tl.store(out + i_b * BT * BT + o_t[:, None] * BT + o_t[None, :], b_M.to(tl.int8))


@pytest.mark.parametrize("kind", SHAPES)
@pytest.mark.parametrize("sizes", [[5, 2], [16, 9, 3], [64, 40], [33]])
def test_in_register_mask_from_parents_equals_twin(kind, sizes):
    """The tile a tree kernel builds from one parent per node (``ANC == 1``, by repeated squaring)
    for trees up to 64 deep (a 64-node chain), entries past a tree's nodes False; ``out``
    pre-filled with 7 so that an unwritten entry fails."""
    parents = batch_parents(kind, sizes, random.Random(len(kind) * 7 + sum(sizes))).to(DEV)
    sizes = [1] * len(sizes) if kind == "single" else sizes  # batch_parents' single-node trees
    B, T = parents.shape
    BT = max(16, triton.next_power_of_2(T))
    out = torch.full((B, BT, BT), 7, dtype=torch.int8, device=DEV)
    _mask_tile_kernel[(B,)](parents, torch.tensor(sizes, device=DEV), out, T, BT=BT, ANC=1)
    want = torch.zeros(B, BT, BT, dtype=torch.int8, device=DEV)
    for b, n in enumerate(sizes):
        want[b, :n, :n] = inclusive_ancestor_mask(parents[b:b + 1, :n])[0].to(torch.int8)
    assert torch.equal(out, want)


def test_root_explicit_trees_and_bad_input():
    """Trees with the root as node 0 (what a verify pass builds): depth 0 for the root."""
    parents = torch.tensor([[-1, 0, 1, 1, 0], [-1, 0, 0, 0, 0]], device=DEV)
    mask, depth = tree_triton.ancestor_mask(parents)
    assert depth.tolist() == [[0, 1, 2, 2, 1], [0, 1, 1, 1, 1]]
    assert torch.equal(mask, inclusive_ancestor_mask(parents))
    with pytest.raises(ValueError, match="parents must be int64"):
        tree_triton.ancestor_mask(parents.int())


def test_trees_past_the_kernel_tile_take_the_twin_and_a_wrong_out_is_refused():
    parents = torch.arange(-1, tree_triton.MAX_NODES + 9, device=DEV)[None].repeat(2, 1)  # a long chain
    mask, depth = tree_triton.ancestor_mask(parents)
    assert torch.equal(mask, inclusive_ancestor_mask(parents)) and depth[0, -1] == parents.shape[1] - 1
    with pytest.raises(ValueError, match="out must be"):
        tree_triton.ancestor_mask(parents[:, :5], out=(torch.empty(2, 5, 4, dtype=torch.bool, device=DEV),
                                                       torch.empty(2, 5, dtype=torch.int64, device=DEV)))
