"""Softmax attention under a draft tree (specla.mixers.attention.reference) against its sequential
twin and against torch's own causal attention, and the KV commit: written exactly where the accepted path
goes, nothing else touched."""

import random

import pytest
import torch
import torch.nn.functional as F

from specla.mixers.attention.naive import naive_tree_attention
from specla.mixers.attention.reference import commit_kv, tree_attention
from specla.tree import inclusive_ancestor_mask
from trees import SHAPES, TOL, needs_triton, rel_err, tree_parents

H, HKV, DH, S = 4, 2, 8, 24


def case(kind, T, dtype, seed, lens=(5, 11)):
    """A batch of two root-explicit trees of shape ``kind`` with ``T - 1`` draft nodes, random
    queries/keys/values, and caches whose slots past ``cache_len`` hold large finite garbage."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    rows = [[-1] + [p + 1 for p in tree_parents(kind, T - 1, rng)] for _ in lens]
    parents = torch.tensor(rows)
    B, T = parents.shape  # a "single" tree has one draft node whatever T asks
    q = torch.randn(B, T, H, DH, generator=g, dtype=torch.float64).to(dtype)
    k, v = (torch.randn(B, T, HKV, DH, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
    kc, vc = (torch.randn(B, S, HKV, DH, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
    cache_len = torch.tensor(lens)
    for c in (kc, vc):
        for b, n in enumerate(lens):
            c[b, n:] = 1e4  # never read
    anc = inclusive_ancestor_mask(parents)
    return q, k, v, kc, vc, cache_len, parents, anc, anc.sum(-1) - 1


@pytest.mark.parametrize("kind", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("window", [None, 3])
def test_tree_attention_equals_its_sequential_twin(kind, dtype, window):
    q, k, v, kc, vc, n, parents, anc, depth = case(kind, 7, dtype, SHAPES.index(kind))
    got = torch.full_like(q, float("nan"))
    got[:] = tree_attention(q, k, v, kc, vc, n, anc, depth, window=window)
    want = naive_tree_attention(q, k, v, kc, vc, n, parents, window=window)
    assert torch.isfinite(got).all()
    assert rel_err(got.double(), want) < TOL[dtype]


def test_a_chain_equals_torchs_causal_attention_over_the_whole_sequence():
    """An independent oracle: for a chain, each node's output is causal attention over cache +
    chain, as ``scaled_dot_product_attention(is_causal=True)`` computes it on the concatenation."""
    q, k, v, kc, vc, n, parents, anc, depth = case("chain", 6, torch.float64, 3, lens=(7, 7))
    got = tree_attention(q, k, v, kc, vc, n, anc, depth)
    g = torch.Generator().manual_seed(9)
    q_prefix = torch.randn(2, 7, H, DH, generator=g, dtype=torch.float64)
    seq_q = torch.cat([q_prefix, q], 1).transpose(1, 2)
    seq_k = torch.cat([kc[:, :7], k], 1).repeat_interleave(H // HKV, 2).transpose(1, 2)
    seq_v = torch.cat([vc[:, :7], v], 1).repeat_interleave(H // HKV, 2).transpose(1, 2)
    want = F.scaled_dot_product_attention(seq_q, seq_k, seq_v, is_causal=True).transpose(1, 2)[:, 7:]
    assert rel_err(got, want) < 1e-12


def test_commit_writes_the_accepted_path_and_nothing_else():
    """Paths of 3, 1 and 0 entries (root first): the slots from ``cache_len`` on hold exactly the
    accepted nodes' keys and values; every other slot, and the whole row with nothing to commit,
    is bit-identical; attention after the commit equals the twin over the longer prefix."""
    q, k, v, kc, vc, _, parents, anc, depth = case("binary", 7, torch.float32, 4, lens=(5, 11, 8))
    n = torch.tensor([5, 11, 8])
    before = (kc.clone(), vc.clone())
    path = torch.tensor([[0, 1, 3], [0, -1, -1], [-1, -1, -1]])
    new_len = commit_kv(kc, vc, n, k, v, path, torch.tensor([3, 1, 0]), capacity=S - 3)
    assert new_len.tolist() == [8, 12, 8]
    for cache, old, src in ((kc, before[0], k), (vc, before[1], v)):
        assert torch.equal(cache[0, 5:8], src[0, [0, 1, 3]]) and torch.equal(cache[1, 11], src[1, 0])
        changed = torch.zeros(3, S, dtype=torch.bool)
        changed[0, 5:8] = changed[1, 11] = True
        assert torch.equal(cache[~changed], old[~changed])
    # the committed prefix now serves the next tree
    q2, k2, v2, _, _, _, parents2, anc2, depth2 = case("star", 4, torch.float32, 5, lens=(8, 12, 8))
    got = tree_attention(q2, k2, v2, kc, vc, new_len, anc2, depth2)
    assert rel_err(got.double(), naive_tree_attention(q2, k2, v2, kc, vc, new_len, parents2)) < TOL[torch.float32]


def test_bad_shapes_and_overflow_are_refused():
    q, k, v, kc, vc, n, parents, anc, depth = case("chain", 4, torch.float32, 1)
    with pytest.raises(ValueError, match="H a multiple of HKV"):
        tree_attention(q[:, :, :3], k, v, kc, vc, n, anc, depth)
    with pytest.raises(ValueError, match=r"caches must be \[B=2, S, HKV=2, Dh=8\]"):
        tree_attention(q, k, v, kc[:, :, :1], vc, n, anc, depth)
    with pytest.raises(ValueError, match="the cache has 24 slots; a capacity of 21 and paths of 4 need 25"):
        commit_kv(kc, vc, torch.tensor([21, 3]), k, v, torch.zeros(2, 4, dtype=torch.int64), torch.tensor([4, 1]),
                  capacity=21)


def test_a_full_cache_stops_growing_and_writes_only_spare_slots():
    """A row at ``capacity`` (a finished sequence kept in a graph's batch) keeps its length and
    its first ``capacity`` slots bit-identical; the other row commits normally."""
    q, k, v, kc, vc, n, parents, anc, depth = case("chain", 4, torch.float32, 1)
    cap = S - 4
    before = kc.clone()
    path = torch.tensor([[0, 1, 2], [0, 1, -1]])
    new_len = commit_kv(kc, vc, torch.tensor([cap, 3]), k, v, path, torch.tensor([3, 2]), capacity=cap)
    assert new_len.tolist() == [cap, 5]
    assert torch.equal(kc[0, :cap], before[0, :cap]) and torch.equal(kc[1, 3:5], k[1, :2])




@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("P,M,A,gather,lens,H,HKV", [(1, 1, 0, False, (0, 70), 3, 3), (3, 4, 2, True, (131, 1), 4, 1),
                                                     (2, 2, 5, False, (64, 128), 3, 3), (4, 3, 1, True, (0, 57), 4, 2)])
def test_draft_level_attention_kernel_equals_its_pytorch_twin(dtype, P, M, A, gather, lens, H, HKV):
    """A draft level read from the previous level's keys and values through the parents' rows
    (``slot``, repeated and out of order) and the nodes' own keys as strided views of one fused
    projection: the one-launch kernel against the PyTorch twin on fresh random inputs, caches
    whose slots past ``cache_len`` hold large garbage, an empty cache, a full one (``cache_len ==
    L``), block edges (64, 128), strided lengths, a head dim that is not a power of two,
    grouped-query heads (4 query heads on 1 or 2 key/value heads), and the outputs pre-filled
    with NaN. The children's keys and values are copies, so they match
    exactly; the attention to float32 rounding (bf16: q rounded for the cache products)."""
    from specla.ops import attention_triton
    from specla.ops.attention import draft_level_attention

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(P * 100 + M * 10 + A)
    B, L, Dh = len(lens), 131, 12
    qkv = torch.randn(B, M, (H + 2 * HKV) * Dh, generator=g).to(dev, dtype)
    q, k, v = qkv.split([H * Dh, HKV * Dh, HKV * Dh], -1)
    q, k, v = q.view(B, M, H, Dh), k.view(B, M, HKV, Dh), v.view(B, M, HKV, Dh)
    ck, cv = (torch.randn(B, L, HKV, Dh, generator=g).to(dev, dtype) for _ in range(2))
    for b, length in enumerate(lens):
        ck[b, length:] = 1e4  # garbage past the valid entries must not be read
        cv[b, length:] = float("nan")
    n = torch.tensor([x for length in lens for x in (length, 99)], device=dev)[::2]  # strided lengths
    rows = P if gather else M
    anc_k, anc_v = (torch.randn(B, rows, A, HKV, Dh, generator=g).to(dev, dtype) for _ in range(2))
    slot = torch.randint(0, P, (B, M), generator=g).to(dev) if gather else None
    out = (torch.full((B, M, H, Dh), float("nan"), device=dev),
           *(torch.full((B, M, A + 1, HKV, Dh), float("nan"), dtype=dtype, device=dev) for _ in range(2)))
    got = attention_triton.draft_level_attention(q, k, v, ck, cv, n, anc_k, anc_v, slot, out=out)
    assert all(a is b for a, b in zip(got, out)) and not any(x.isnan().any() for x in got)
    want = draft_level_attention(q.double(), k.double(), v.double(), ck.double(), torch.nan_to_num(cv.double()), n,
                                 anc_k.double(), anc_v.double(), slot)
    assert torch.equal(got[1].double(), want[1]) and torch.equal(got[2].double(), want[2])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got[0].double() - want[0]).abs().max() < tol


@needs_triton
def test_draft_level_attention_kernel_refuses_what_it_cannot_run():
    from specla.ops import attention_triton

    q = torch.randn(1, 2, 2, 8)
    ck = torch.randn(1, 5, 2, 8)
    keys = torch.randn(1, 2, 1, 2, 8)
    n = torch.tensor([3])
    with pytest.raises(ValueError, match=r"expected q \[B, M, H, Dh\]"):
        attention_triton.draft_level_attention(q, q, q, ck, ck, n, keys[:, :, :, :1], keys[:, :, :, :1])
    q3 = torch.randn(1, 2, 3, 8)  # 3 query heads on 2 key/value heads: not a grouping
    with pytest.raises(ValueError, match="HKV dividing H"):
        attention_triton.draft_level_attention(q3, q, q, ck, ck, n, keys, keys)
    with pytest.raises(ValueError, match="float64"):
        attention_triton.draft_level_attention(*(x.double() for x in (q, q, q, ck, ck)), n, keys.double(),
                                               keys.double())
    with pytest.raises(ValueError, match="dense"):
        attention_triton.draft_level_attention(q.transpose(2, 3).contiguous().transpose(2, 3), q, q, ck, ck, n, keys,
                                               keys)
    anc = torch.randn(1, 3, 1, 2, 8)  # a level's form: 3 parents' rows for 2 nodes
    with pytest.raises(ValueError, match=r"or None with P == M"):
        attention_triton.draft_level_attention(q, q, q, ck, ck, n, anc, anc)  # no slot
    with pytest.raises(ValueError, match=r"or None with P == M"):
        attention_triton.draft_level_attention(q, q, q, ck, ck, n, anc, anc, torch.zeros(1, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="out must be"):
        attention_triton.draft_level_attention(q, q, q, ck, ck, n, anc, anc, torch.zeros(1, 2, dtype=torch.int64),
                                               out=(torch.empty(1, 2, 2, 8), torch.empty(1, 2, 1, 2, 8),
                                                    torch.empty(1, 2, 2, 2, 8)))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("W,E", [(1, 12), (7, 36), (3, 1100)])
@pytest.mark.parametrize("fused", [False, True])
def test_append_kv_kernel_equals_its_pytorch_twin(dtype, W, E, fused):
    """A step's pairs appended to a drafter's cache: rows at lengths 0, mid-cache, one short of
    full (its overflow lands in the last slot, the last pair last) and full; a width past one
    block (1100 = 4 x 275); every other slot untouched (pre-filled with NaN, compared bit for
    bit with ``equal_nan``); lengths updated in place. ``fused``: keys and values are strided
    views, the chunks of one ``[B, W, 3E]`` projection, read in place."""
    from specla.ops import attention_triton
    from specla.ops.attention import append_kv

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(W * 1000 + E)
    L, H = 9, 4 if E % 4 == 0 else 1
    lens = torch.tensor([0, 4, L - 1, L], device=dev)
    B = len(lens)
    if fused:
        _, k, v = (x.reshape(B, W, H, E // H) for x in torch.randn(B, W, 3 * E, generator=g).to(dev, dtype).chunk(3, -1))
        assert not k.is_contiguous()
    else:
        k, v = (torch.randn(B, W, H, E // H, generator=g).to(dev, dtype) for _ in range(2))
    num = torch.randint(0, W, (B,), generator=g).to(dev)
    caches = [torch.full((B, L, H, E // H), float("nan"), dtype=dtype, device=dev) for _ in range(2)]
    want = [c.clone() for c in caches] + [lens.clone()]
    got = caches + [lens.clone()]
    attention_triton.append_kv(got[0], got[1], got[2], k, v, num)
    append_kv(want[0], want[1], want[2], k, v, num)
    assert torch.equal(got[2], want[2]) and got[2].tolist() == [min(n + a + 1, L) for n, a in
                                                                zip(lens.tolist(), num.tolist())]
    for a, b in zip(got[:2], want[:2]):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
    assert torch.equal(got[0][1, 4 : 4 + W if 4 + W < L else L - 1], k[1, : min(W, L - 5)])
    assert torch.equal(got[0][3, L - 1], k[3, W - 1])  # a full row: its last slot holds the last pair
    with pytest.raises(ValueError, match="append_kv: caches"):
        attention_triton.append_kv(got[0], got[1], got[2].int(), k, v, num)
