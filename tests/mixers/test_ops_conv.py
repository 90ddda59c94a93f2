"""The shared tree short-convolution operators (specla.ops) against their sequential twins:
the batched PyTorch form and the Triton kernels (CPU: Triton interpreter; GPU: compiled)."""

import random

import pytest
import torch

from specla.ops import conv_triton as conv_kernels
from specla.ops.conv import causal_conv, conv_ancestors, conv_window_after, conv_windows_per_node, tree_conv
from specla.ops.naive import naive_tree_conv, root_path
from trees import DEV, SHAPES, TOL, batch_parents, rel_err, tree_parents





@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kind", SHAPES)
@pytest.mark.parametrize("width", [2, 4])
def test_tree_conv_and_windows_equal_per_path(kind, width, dtype, rng):
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    parents = batch_parents(kind, [6, 2], rng)
    B, T, D = 2, parents.shape[1], 5
    x = torch.randn(B, T, D, generator=gen, dtype=dtype)
    window = torch.randn(B, width - 1, D, generator=gen, dtype=dtype)
    weight = torch.randn(D, width, generator=gen, dtype=dtype)
    bias = torch.randn(D, generator=gen, dtype=dtype)
    anc = conv_ancestors(parents, width)
    y = tree_conv(x, window, weight, bias, anc)
    ry, rwin = naive_tree_conv(x, window, weight, bias, parents)
    assert rel_err(y, ry) < TOL[dtype]
    assert torch.equal(conv_windows_per_node(x, window, anc), rwin)  # pure gathers: exact
    for node in range(T):
        paths = [torch.tensor(root_path(parents[b].tolist(), node)) for b in range(B)]
        path = torch.nn.utils.rnn.pad_sequence(paths, batch_first=True, padding_value=-1)
        plen = torch.tensor([len(p) for p in paths])
        assert torch.equal(conv_window_after(x, window, path, plen), rwin[:, node])
    empty = conv_window_after(x, window, torch.full((B, 1), -1), torch.zeros(B, dtype=torch.int64))
    assert torch.equal(empty, window)


@pytest.mark.parametrize("kind", SHAPES)
@pytest.mark.parametrize("width", [1, 2, 3, 4])
def test_conv_ancestors_kernel_equals_the_pytorch_table(kind, width, rng):
    """The one-launch ``conv_ancestors`` equals the PyTorch table on random ragged trees (every
    entry: the output is pre-filled with a value no index takes, so an unwritten one fails);
    ``TreePass.conv_ancestors`` computes it once per pass; bad input is refused by name."""
    from specla.mixers import TreePass

    parents = batch_parents(kind, [9, 4, 1], rng).to(DEV)
    B, T = parents.shape
    out = torch.full((B, T, width), -7, dtype=torch.int64, device=DEV)
    got = conv_kernels.conv_ancestors(parents, width, out=out)
    assert got is out and torch.equal(got.cpu(), conv_ancestors(parents.cpu(), width))
    tp = TreePass(parents, torch.full((B,), T, device=DEV), None, None, "factor", True, False)
    assert tp.conv_ancestors(width) is tp.conv_ancestors(width)
    assert torch.equal(tp.conv_ancestors(width).cpu(), conv_ancestors(parents.cpu(), width))
    with pytest.raises(ValueError, match="width >= 1"):
        conv_kernels.conv_ancestors(parents, 0)
    with pytest.raises(ValueError, match="out must be int64"):
        conv_kernels.conv_ancestors(parents, width, out=out.transpose(0, 1))


@pytest.fixture(params=["default", "small tiles"])
def conv_tile(request, monkeypatch):
    """The tree conv kernel's programs: the default (one node each at these sizes), and tiles of
    4 nodes by 16 channels, so that a 7-node tree spans two node blocks (the last one partial) and
    37 channels three column blocks."""
    if request.param == "small tiles":
        monkeypatch.setattr(conv_kernels, "TUNING", {"node_programs": 0, "rows": 4, "BD": 16, "tile": 64})
    return request.param


@pytest.mark.parametrize("kind", SHAPES)
@pytest.mark.parametrize("width, bias", [(4, False), (2, True), (3, True), (1, True)])  # 1: no window
def test_tree_conv_and_commit_kernels_equal_naive(kind, width, bias, conv_tile):
    rng = random.Random(width * 13 + len(kind))
    sizes = [1, 1] if kind == "single" else [7, 3]
    T, B, D = max(sizes), 2, 37
    parents = torch.tensor([tree_parents(kind, n, rng) + [-1] * (T - n) for n in sizes])
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    wide = torch.randn(B, T, D + 11, generator=gen)
    x = wide[..., 5 : 5 + D]
    xd = wide.to(DEV)[..., 5 : 5 + D]  # strided rows: a slice of a wider projection, as GDN passes them
    window = torch.randn(B, width - 1, D, generator=gen)
    weight = torch.randn(D, width, generator=gen)
    b = torch.randn(D, generator=gen) if bias else None
    anc = conv_ancestors(parents, width)
    y = conv_kernels.tree_conv(xd, *(t.to(DEV) for t in (window, weight)), b.to(DEV) if bias else None, anc.to(DEV),
                               out=torch.full((B, T, D), float("nan"), device=DEV))
    ry, rwin = naive_tree_conv(x, window, weight, b, parents)
    assert torch.allclose(y.cpu(), ry, rtol=1e-5, atol=1e-5)
    for node in range(T):
        paths = [root_path(parents[r].tolist(), node) for r in range(B)]
        P = max(len(p) for p in paths)
        path = torch.tensor([p + [-1] * (P - len(p)) for p in paths])
        plen = torch.tensor([len(p) for p in paths])
        new = conv_kernels.conv_commit(xd, window.to(DEV), path.to(DEV), plen.to(DEV),
                                       out=torch.full_like(window, float("nan")).to(DEV))
        assert torch.equal(new.cpu(), rwin[:, node])  # pure gathers: exact
        inplace = window.to(DEV, copy=True)  # slot s reads slot path_len + s of the window it overwrites
        assert conv_kernels.conv_commit(xd, inplace, path.to(DEV), plen.to(DEV), out=inplace) is inplace
        assert torch.equal(inplace.cpu(), rwin[:, node])
    same = conv_kernels.conv_commit(xd, window.to(DEV), torch.full((B, 1), -1, device=DEV),
                                    torch.zeros(B, dtype=torch.int64, device=DEV))
    assert torch.equal(same.cpu(), window)  # nothing accepted: bit-identical
    empty = conv_kernels.conv_commit(xd, window.to(DEV), torch.zeros(B, 0, dtype=torch.int64, device=DEV),
                                     torch.zeros(B, dtype=torch.int64, device=DEV))
    assert torch.equal(empty.cpu(), window)  # an empty path: nothing read from it


@pytest.mark.parametrize("layout", ["sequence-major", "channels-major"])
def test_tree_conv_kernel_takes_any_input_layout_and_refuses_bad_outs(layout, conv_tile):
    """x stored [T, B, D] or [B, D, T] (seen through a transpose), a strided bias: the same values
    as the contiguous twin, in a dense output; an out it cannot write densely, of another dtype or
    shape, is refused with nothing written; an empty channel dim returns an empty result."""
    B, T, D, C = 3, 5, 7, 3
    gen = torch.Generator().manual_seed(3)
    parents = torch.tensor([[-1, 0, 1, 1, 3]] * B)
    x = (torch.randn(T, B, D, generator=gen).transpose(0, 1) if layout == "sequence-major"
         else torch.randn(B, D, T, generator=gen).transpose(1, 2))
    window, weight = torch.randn(B, C - 1, D, generator=gen), torch.randn(D, C, generator=gen)
    bias = torch.randn(2 * D, generator=gen)[::2]
    anc = conv_ancestors(parents, C)
    y = conv_kernels.tree_conv(x.to(DEV), window.to(DEV), weight.to(DEV), bias.to(DEV), anc.to(DEV))
    ref = tree_conv(x.contiguous(), window, weight, bias.contiguous(), anc)
    assert y.is_contiguous() and torch.allclose(y.cpu(), ref, rtol=1e-5, atol=1e-5)
    args = [t.to(DEV) for t in (x, window, weight, bias, anc)]
    transposed = torch.full((B, D, T), float("nan"), device=DEV).transpose(1, 2)
    wide = torch.full((B, T, D), float("nan"), device=DEV, dtype=torch.float64)
    longer = torch.full((B, T + 1, D), float("nan"), device=DEV)
    for out, match in ((transposed, r"\(\(3, 5, 7\), torch.float32, False"),
                       (wide, r"\(\(3, 5, 7\), torch.float64, True"), (longer, r"\(\(3, 6, 7\), torch.float32, True")):
        with pytest.raises(ValueError, match=match):
            conv_kernels.tree_conv(*args, out=out)
        assert out.isnan().all()  # nothing written
    with pytest.raises(ValueError, match=r"expected bias \[D\] = \[7\]; got \[8\]"):
        conv_kernels.tree_conv(*args[:3], torch.zeros(8, device=DEV), args[4])
    empty = conv_kernels.tree_conv(*(t[..., :0] for t in args[:2]), weight[:0].to(DEV), None, args[4])
    assert empty.shape == (B, T, 0)


def test_conv_commit_refuses_an_out_it_cannot_write_densely():
    x, window = torch.randn(2, 3, 8, device=DEV), torch.randn(2, 3, 8, device=DEV)
    path, plen = torch.zeros(2, 1, dtype=torch.int64, device=DEV), torch.ones(2, dtype=torch.int64, device=DEV)
    out = torch.full((2, 8, 3), float("nan"), device=DEV).transpose(1, 2)
    with pytest.raises(ValueError, match=r"expected out contiguous \[B, W, D\] = \[2, 3, 8\]; got \[2, 3, 8\]"):
        conv_kernels.conv_commit(x, window, path, plen, out=out)
    assert out.isnan().all()  # nothing written
    with pytest.raises(ValueError, match=r"got \[2, 2, 8\]"):
        conv_kernels.conv_commit(x, window, path, plen, out=torch.empty(2, 2, 8, device=DEV))


def test_causal_conv_equals_tree_conv_on_a_chain_from_an_empty_window(rng):
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    B, T, D, C = 2, 9, 6, 4
    x = torch.randn(B, T, D, generator=gen)
    weight, bias = torch.randn(D, C, generator=gen), torch.randn(D, generator=gen)
    chain = torch.arange(-1, T - 1).expand(B, T)
    ref, _ = naive_tree_conv(x, torch.zeros(B, C - 1, D), weight, bias, chain)
    assert rel_err(causal_conv(x, weight, bias), ref) < 1e-6


def test_commit_window_in_place_on_the_kernel_path():
    """``RecurrentMixer.commit_window``: on the kernel path a contiguous window is written in
    place (the tensor a recorded step holds stays the window); a strided window (a view given as
    state) gets a new tensor; both equal :func:`conv_window_after`, as the reference path does."""
    from specla.mixers import RecurrentMixer

    class Window(RecurrentMixer):  # only the window: the abstract methods are not reached
        verify = empty_record = commit = empty_state = None

    gen = torch.Generator().manual_seed(11)
    x = torch.randn(2, 4, 8, generator=gen).to(DEV)
    path, plen = torch.tensor([[0, 2], [0, -1]], device=DEV), torch.tensor([2, 1], device=DEV)
    m = Window.__new__(Window)
    for window, kernel in ((torch.randn(2, 3, 8, generator=gen), True),
                           (torch.randn(2, 8, 3, generator=gen).transpose(1, 2), True),
                           (torch.randn(2, 3, 8, generator=gen), False)):
        m.conv = window.to(DEV)
        before = m.conv
        want = conv_window_after(x, before.clone(), path, plen)
        m.commit_window(x, path, plen, kernel)
        assert torch.equal(m.conv, want)
        assert (m.conv is before) == (kernel and window.is_contiguous())
    m.conv = None
    m.commit_window(x, path, plen, True)  # no short convolution: nothing to move
    assert m.conv is None
