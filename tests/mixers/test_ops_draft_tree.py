"""The draft-tree bookkeeping kernels (``specla.ops.draft_tree_triton``) against their PyTorch
twins (``specla.drafters.pruning.next_frontier`` and ``select_nodes``), on fresh random inputs
with many ties (scores drawn from a few values), under ``TRITON_INTERPRET=1`` on the CPU and
compiled on a GPU."""

import pytest
import torch

from specla import SpecConfig
from specla.drafters.pruning import accepted_rows, build_tree, next_frontier, pair_rows, select_nodes
from specla.ops import draft_tree_triton as dt
from trees import DEV


def coarse(shape, g, levels=4):
    """Random float32 values from ``levels`` distinct negative values (ties are common)."""
    return -torch.randint(0, levels, shape, generator=g).float().to(DEV) * 0.5


@pytest.mark.parametrize("M,k", [(1, 1), (1, 4), (3, 3), (4, 4), (8, 16)])
@pytest.mark.parametrize("last", [False, True])
def test_level_equals_twin(M, k, last):
    """The level's candidates land in their columns (the rest of the rows untouched: pre-filled
    with NaN / -77) and the next frontier equals the twin's, ties to the lower index."""
    g = torch.Generator().manual_seed(M * 100 + k)
    B, off, C = 3, 5, 5 + M * k + 4
    fscore, logp = coarse((B, M), g), coarse((B, M, k), g)
    child = torch.randint(0, 1000, (B, M, k), generator=g).to(DEV)
    ids = torch.randint(-1, 50, (B, M), generator=g).to(DEV)
    rows = (torch.full((B, C), float("nan"), device=DEV), torch.full((B, C), -77, dtype=torch.int64, device=DEV),
            torch.full((B, C), -77, dtype=torch.int64, device=DEV))
    nxt = dt.level(fscore, logp, child, ids, off, last, *rows)
    cand, parents, ref = next_frontier(fscore, logp, child, ids, off, last)
    cols = slice(off, off + M * k)
    assert torch.equal(rows[0][:, cols], cand)
    assert torch.equal(rows[1][:, cols], child.flatten(1)) and torch.equal(rows[2][:, cols], parents)
    assert rows[0][:, :off].isnan().all() and rows[0][:, off + M * k:].isnan().all()
    assert (rows[1][:, :off] == -77).all() and (rows[2][:, off + M * k:] == -77).all()
    if last:
        assert nxt is None and ref is None
    else:
        for a, b in zip(nxt, ref):
            assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("M,k,V", [(1, 1, 7), (1, 4, 3000), (3, 3, 1100), (4, 4, 2048), (2, 16, 40), (5, 20, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("last", [False, True])
def test_topk_level_equals_twin(M, k, V, dtype, last):
    """A level from the drafter's logits (the top-k's block launch, then its merge and the
    level's bookkeeping in one launch) equals ``log_softmax_topk`` and ``next_frontier``: logits
    with many exact ties (coarse values, so the smaller id must win) spread over several
    1024-entry blocks, rows of every frontier node, the root's level (``M == 1`` with no frontier
    tensors) and a ``k`` above the kernel's 16 (two launches of the twins' kernels); the rows'
    other columns untouched (pre-filled with NaN / -77)."""
    from specla.ops.topk import log_softmax_topk

    g = torch.Generator().manual_seed(M * 1000 + k * 10 + V)
    B, off = 3, 4
    C = off + M * k + 3
    logits = (torch.randint(0, 6, (B, M, V), generator=g).float() * 0.75).to(DEV, dtype)
    root = M == 1
    fscore = None if root else coarse((B, M), g)
    ids = None if root else torch.randint(-1, 50, (B, M), generator=g).to(DEV)
    rows = (torch.full((B, C), float("nan"), device=DEV), torch.full((B, C), -77, dtype=torch.int64, device=DEV),
            torch.full((B, C), -77, dtype=torch.int64, device=DEV))
    nxt = dt.topk_level(fscore, logits, ids, k, off, last, *rows)
    logp, child = log_softmax_topk(logits, k)
    cand, parents, ref = next_frontier(torch.zeros(B, 1, device=DEV) if root else fscore, logp.float(), child,
                                       torch.full((B, 1), -1, dtype=torch.int64, device=DEV) if root else ids, off, last)
    cols = slice(off, off + M * k)
    assert torch.equal(rows[1][:, cols], child.flatten(1)) and torch.equal(rows[2][:, cols], parents)
    torch.testing.assert_close(rows[0][:, cols], cand, rtol=0, atol=2e-6)  # the log-sum-exp's summation order
    assert rows[0][:, :off].isnan().all() and rows[0][:, off + M * k:].isnan().all()
    assert (rows[1][:, :off] == -77).all() and (rows[2][:, off + M * k:] == -77).all()
    if last:
        assert nxt is None and ref is None
    else:
        for a, b in zip(nxt[:3], ref[:3]):
            assert a.dtype == b.dtype and torch.equal(a, b)
        torch.testing.assert_close(nxt[3], ref[3], rtol=0, atol=2e-6)


def test_topk_level_counts_its_programs_and_leaves_the_counter_zeroed():
    """One counter through a tree's levels, back to back: each level's last program of a sequence
    merges its blocks, and the counter comes back zeroed for the next. Many sequences at once (on
    a GPU 64 sequences of 4 nodes over 32 blocks: 8,192 programs finishing in any order, 20
    rounds), each level equal to the twins; a counter that is not a ``LevelCounter`` of the
    batch, and logits that are not ``[B, M, V]`` floats, are refused before anything runs (the
    rows untouched)."""
    from specla.ops.topk import log_softmax_topk

    g = torch.Generator().manual_seed(5)
    B, M, k, V, rounds = (64, 4, 4, 32000, 20) if DEV == "cuda" else (3, 4, 4, 2100, 2)
    counter = dt.LevelCounter(B, DEV)
    C = 4 + 4 * M * k
    for r in range(rounds):
        rows = (torch.full((B, C), float("nan"), device=DEV), torch.full((B, C), -77, dtype=torch.int64, device=DEV),
                torch.full((B, C), -77, dtype=torch.int64, device=DEV))
        fscore, ids = None, None
        for level_no, (m, off) in enumerate([(1, 0), (M, k), (M, k + M * k)]):
            logits = (torch.randint(0, 40, (B, m, V), generator=g).float() * 0.25).to(DEV, torch.bfloat16)
            nxt = dt.topk_level(fscore, logits, ids, k, off, False, *rows, counter=counter)
            assert not counter.counts.any(), f"round {r}, level {level_no}: the counter was not left zeroed"
            logp, child = log_softmax_topk(logits, k)
            cand, parents, ref = next_frontier(
                torch.zeros(B, 1, device=DEV) if fscore is None else fscore, logp.float(), child,
                torch.full((B, 1), -1, dtype=torch.int64, device=DEV) if ids is None else ids, off, False)
            cols = slice(off, off + m * k)
            assert torch.equal(rows[1][:, cols], child.flatten(1)) and torch.equal(rows[2][:, cols], parents)
            # a few float32 ulps at |score| ~ 10: 32 blocks' sums merged against one row-wide sum
            torch.testing.assert_close(rows[0][:, cols], cand, rtol=0, atol=1e-5)
            for a, b in zip(nxt[:3], ref[:3]):
                assert torch.equal(a, b), f"round {r}, level {level_no}"
            torch.testing.assert_close(nxt[3], ref[3], rtol=0, atol=1e-5)
            _, _, ids, fscore = nxt  # k == M: each level's frontier has M nodes
    logits = torch.randn(B, 1, V, generator=g).to(DEV)
    rows = (torch.full((B, C), float("nan"), device=DEV), torch.full((B, C), -77, dtype=torch.int64, device=DEV),
            torch.full((B, C), -77, dtype=torch.int64, device=DEV))
    for bad, got in ((counter.counts, "Tensor"), ([0] * B, "list"), (dt.LevelCounter(B + 1, DEV), f"of {B + 1} on")):
        with pytest.raises(ValueError, match=f"counter must be a LevelCounter of B = {B} sequences on .*; got .*{got}"):
            dt.topk_level(None, logits, None, k, 0, False, *rows, counter=bad)
    for bad in (logits[:, 0], logits.long()):
        with pytest.raises(ValueError, match=r"logits must be \[B, M, V\] floats"):
            dt.topk_level(None, bad, None, k, 0, False, *rows)
    assert rows[0].isnan().all() and (rows[1] == -77).all() and (rows[2] == -77).all()


@pytest.mark.parametrize("k", [1, 4, 16])
@pytest.mark.parametrize("last", [False, True])
def test_root_level_equals_twin(k, last):
    """The roots' level with no frontier tensors (``fscore`` and ``ids`` ``None``: score 0, parent
    -1 implied, as a recorded draft step runs it) equals the twin given the zeros and -1s; a
    frontier of more than one node, or one of the two given without the other, is refused."""
    g = torch.Generator().manual_seed(k)
    B, off, C = 3, 2, 2 + k + 3
    logp = coarse((B, 1, k), g)
    child = torch.randint(0, 1000, (B, 1, k), generator=g).to(DEV)
    rows = (torch.full((B, C), float("nan"), device=DEV), torch.full((B, C), -77, dtype=torch.int64, device=DEV),
            torch.full((B, C), -77, dtype=torch.int64, device=DEV))
    nxt = dt.level(None, logp, child, None, off, last, *rows)
    cand, parents, ref = next_frontier(torch.zeros(B, 1, device=DEV), logp, child,
                                       torch.full((B, 1), -1, dtype=torch.int64, device=DEV), off, last)
    cols = slice(off, off + k)
    assert torch.equal(rows[0][:, cols], cand) and torch.equal(rows[2][:, cols], parents)
    assert torch.equal(rows[1][:, cols], child.flatten(1))
    assert rows[0][:, :off].isnan().all() and (rows[2][:, off + k:] == -77).all()
    assert (nxt is None and ref is None) if last else all(torch.equal(a, b) for a, b in zip(nxt, ref))
    with pytest.raises(ValueError, match="one frontier node"):
        dt.level(None, logp.expand(B, 2, k).contiguous(), child.expand(B, 2, k).contiguous(), None, 0, last, *rows)
    with pytest.raises(ValueError, match="or both None"):
        dt.level(torch.zeros(B, 1, device=DEV), logp, child, None, off, last, *rows)


@pytest.mark.parametrize("budget,tau", [(1, float("inf")), (7, float("inf")), (15, 1.0), (40, 0.0), (200, 2.5)])
def test_select_equals_twin(budget, tau):
    """Random candidate rows with tied scores and depths; some rows all ``-inf``."""
    g = torch.Generator().manual_seed(budget)
    B, C = 5, 84
    score = coarse((B, C), g, levels=6)
    score[1] = float("-inf")
    depth = torch.sort(torch.randint(1, 7, (C,), generator=g)).values.to(DEV)
    parent = torch.stack([torch.randint(-1, max(i, 1), (B,), generator=g) for i in range(C)], 1).to(DEV)
    token = torch.randint(0, 1000, (B, C), generator=g).to(DEV)
    tok, par, num = dt.select_nodes(score, token, parent, depth, budget, tau)
    ref = select_nodes(score, token, parent, depth.expand(B, -1), budget, tau, fixed_width=True)
    assert torch.equal(num, ref.num_nodes)
    assert torch.equal(tok, ref.tokens) and torch.equal(par, ref.parents)


def test_nan_scores_rank_last_in_both_forms():
    """A NaN log-probability (an overflowed logit) ranks below every number, in the level and in
    the selection, in the kernels as in the twins (a NaN once gave two candidates one rank and
    the kernel a frontier slot past the level)."""
    g = torch.Generator().manual_seed(5)
    B, M, k = 2, 2, 3
    fscore, logp = coarse((B, M), g), coarse((B, M, k), g)
    logp[0, 0, 1] = logp[0, 1, 2] = logp[1, :, :] = float("nan")
    logp[1, 1, 0] = -1.0
    child = torch.randint(0, 1000, (B, M, k), generator=g).to(DEV)
    ids = torch.tensor([[0, 1], [2, 3]], device=DEV)
    rows = tuple(torch.empty(B, M * k, dtype=t, device=DEV) for t in (torch.float32, torch.int64, torch.int64))
    nxt = dt.level(fscore, logp, child, ids, 0, False, *rows)
    cand, _, ref = next_frontier(fscore, logp, child, ids, 0, False)
    assert not cand.isnan().any() and torch.equal(rows[0], cand)
    assert all(torch.equal(a, b) for a, b in zip(nxt, ref))
    assert (nxt[0] < M).all() and nxt[0][1, 0] == 1  # the one number of row 1 comes first
    score = coarse((B, 12), g)
    score[0, 3] = score[1, :] = float("nan")
    depth, parent = torch.arange(1, 13, device=DEV), torch.arange(-1, 11, device=DEV).expand(B, -1).contiguous()
    token = torch.arange(100, 112, device=DEV).expand(B, -1).contiguous()
    tok, par, num = dt.select_nodes(score, token, parent, depth, 5, 1.0)
    ref = select_nodes(score, token, parent, depth.expand(B, -1), 5, 1.0, fixed_width=True)
    assert torch.equal(num, ref.num_nodes) and torch.equal(tok, ref.tokens) and torch.equal(par, ref.parents)


@pytest.mark.parametrize("P,M,H,gather", [(1, 1, 24, False), (4, 4, 40, True), (3, 2, 1100, True)])
def test_pair_rows_equals_twin(P, M, H, gather):
    """A level's (parent feature, embedding) pairs: parents' rows repeated and out of order, a
    width past one block (1100), the output pre-filled with NaN; copies, so exactly equal."""
    g = torch.Generator().manual_seed(P + M + H)
    B = 3
    feats = torch.randn(B, P if gather else M, H, generator=g).to(DEV)
    emb = torch.randn(B, M, H, generator=g).to(DEV)
    slot = torch.randint(0, P, (B, M), generator=g).to(DEV) if gather else None
    out = torch.full((B, M, 2 * H), float("nan"), device=DEV)
    got = dt.pair_rows(feats, slot, emb, out=out)
    assert got is out and torch.equal(got, pair_rows(feats, slot, emb))
    # the embeddings gathered from a table by token (ids repeated, the table's last row)
    table = torch.randn(50, H, generator=g).to(DEV)
    tokens = torch.randint(0, 50, (B, M), generator=g)
    tokens[0, 0] = 49
    tokens = tokens.to(DEV)
    for dtype in (torch.float32, torch.bfloat16):
        f, t = feats.to(dtype), table.to(dtype)
        out = torch.full((B, M, 2 * H), float("nan"), dtype=dtype, device=DEV)
        got = dt.pair_rows(f, slot, t, out=out, tokens=tokens)
        assert got is out and torch.equal(got, pair_rows(f, slot, t, tokens=tokens))
        assert torch.equal(got[..., H:], t[tokens])
    with pytest.raises(ValueError, match="pair_rows: feats"):
        dt.pair_rows(feats, slot, table, tokens=tokens.int())
    with pytest.raises(ValueError, match="pair_rows: feats"):
        dt.pair_rows(feats, slot, table[:, :-1], tokens=tokens)
    with pytest.raises(ValueError, match="pair_rows: feats"):
        dt.pair_rows(feats.double(), slot, emb)


@pytest.mark.parametrize("D,H", [(1, 24), (4, 40), (6, 1100)])
def test_accepted_rows_equals_twin(D, H):
    """A step's accepted pairs and new feature: paths of every length (0 to D accepted, -1
    padding after), a width past one block (1100), the outputs pre-filled with NaN / -77;
    copies, so exactly equal."""
    g = torch.Generator().manual_seed(D * 10 + H)
    B, T = 4, D + 3
    feature, hidden = torch.randn(B, H, generator=g).to(DEV), torch.randn(B, T, H, generator=g).to(DEV)
    num = torch.tensor([0, D, min(1, D), D // 2]).to(DEV)
    path = torch.full((B, D + 1), -1, dtype=torch.int64)
    tokens = torch.full((B, D), -1, dtype=torch.int64)
    for b, n in enumerate(num.tolist()):
        path[b, : n + 1] = torch.cat([torch.zeros(1, dtype=torch.int64), torch.randperm(T - 1, generator=g)[:n] + 1])
        tokens[b, :n] = torch.randint(0, 500, (n,), generator=g)
    path, tokens = path.to(DEV), tokens.to(DEV)
    root = torch.randint(0, 500, (B,), generator=g).to(DEV)
    out = (torch.full((B, D + 1, H), float("nan"), device=DEV), torch.full((B, D + 1), -77, device=DEV),
           torch.full((B, H), float("nan"), device=DEV))
    got = dt.accepted_rows(feature, hidden, path, num, root, tokens, out=out)
    want = accepted_rows(feature, hidden, path, num, root, tokens)
    assert all(a is b for a, b in zip(got, out))
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert torch.equal(got[2][1], hidden[1, path[1, D]]) and torch.equal(got[0][:, 0], feature)
    with pytest.raises(ValueError, match="accepted_rows: feature"):
        dt.accepted_rows(feature.double(), hidden, path, num, root, tokens)


def table_expand(seed, V=40):
    """A drafter that predicts from the last token only, with coarse (tied) log-probabilities
    (its logits; the tree takes each node's ``top_k`` best children)."""
    g = torch.Generator().manual_seed(seed)
    logp = torch.log_softmax(torch.randint(0, 5, (V, V), generator=g).float(), -1).to(DEV)

    def expand(state, slot, tokens):
        return state, logp[tokens]  # log-probabilities are their own logits

    return expand


@pytest.mark.parametrize("N,D,k,tau", [(15, 6, 4, float("inf")), (6, 6, 1, float("inf")), (20, 4, 3, 1.0),
                                       (8, 3, 8, float("inf")), (63, 8, 4, 0.5)])
@pytest.mark.parametrize("fixed_width", [False, True])
def test_build_tree_with_kernels_is_the_same_tree(N, D, k, tau, fixed_width):
    """Whole trees, kernels against PyTorch forms (k 8, depth 3: 136 candidates, past the kernels'
    tile: every level takes the twins)."""
    expand = table_expand(N + k)
    roots = torch.tensor([0, 3, 3, 17, 39], device=DEV)
    state = torch.zeros(5, 2, device=DEV)
    cfg = SpecConfig(num_draft_tokens=N, max_depth=D, top_k=k, tau_tree=tau)
    a = build_tree(expand, state, roots, cfg, fixed_width=fixed_width, kernels=True)
    b = build_tree(expand, state, roots, cfg, fixed_width=fixed_width, kernels=False)
    assert torch.equal(a.num_nodes, b.num_nodes)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)


def test_bad_buffers_and_too_many_candidates_are_refused():
    B, M, k = 2, 2, 3
    args = (torch.zeros(B, M, device=DEV), torch.zeros(B, M, k, device=DEV),
            torch.zeros(B, M, k, dtype=torch.int64, device=DEV), torch.zeros(B, M, dtype=torch.int64, device=DEV))
    with pytest.raises(ValueError, match="out must be"):
        dt.level(*args, 0, False, torch.empty(B, 8, device=DEV), torch.empty(B, 8, device=DEV),
                 torch.empty(B, 8, dtype=torch.int64, device=DEV))
    rows = (torch.empty(B, 5, device=DEV), *(torch.empty(B, 5, dtype=torch.int64, device=DEV) for _ in range(2)))
    with pytest.raises(ValueError, match="do not fit"):
        dt.level(*args, 0, False, *rows)
    C = dt.MAX_CANDIDATES + 1
    with pytest.raises(ValueError, match="more than the kernel"):
        dt.select_nodes(torch.zeros(1, C, device=DEV), torch.zeros(1, C, dtype=torch.int64, device=DEV),
                        torch.zeros(1, C, dtype=torch.int64, device=DEV), torch.ones(C, dtype=torch.int64, device=DEV),
                        4, 1.0)
