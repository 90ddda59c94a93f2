"""specla's KDA verify and commit on a serving engine's data (``specla.mixers.kda.serving``)
against the engines' own published Triton kernels, on ``engine_cases.DEV``: compiled on a CUDA
machine, under Triton's interpreter on the CPU.

The engines' kernel files come from the package registry at test time, at pinned versions
(:mod:`specla.testing.engine_kernels`: downloaded once into a per-user cache, imported by file
with the package-level helpers they import stubbed). Without network the tests skip, saying so.

Oracles: SGLang 0.5.23's per-node tree verify for KDA (``fused_sigmoid_gating_delta_rule_update``
with ``is_kda=True``, ``retrieve_parent_token`` and ``intermediate_states_buffer``, as
``TritonKDAKernel.target_verify`` calls it; the committed state is the accepted node's snapshot)
and its KDA ReplaySSM (the same kernel's ring writes of raw k, v, per-channel gate and beta,
replayed on commit by ``commit_kda_replayssm_spec``); vLLM 0.34.0's KDA chain speculative kernel
(``fused_recurrent_kda``, one state slot per draft position, Kimi Linear's spec path).
Tolerances: the largest errors observed (noted at each assertion) with a margin of about 10x.
"""

from __future__ import annotations

import re

import pytest
import torch

from specla.mixers.kda import verify as kda_verify
from specla.mixers.kda.serving import KDARecordBuffers, empty_record_buffers, kda_pool_commit, kda_pool_verify
from specla.ops.naive import root_path
from specla.testing import engine_kernels
from engine_cases import CHAIN_ACCEPTED, CHAIN_LENS, DEV, accepted_positions, chain_cu_seqlens, load_or_skip
from tree_speculation import plain_decode, speculate


@pytest.fixture(scope="module")
def sglang():
    """SGLang 0.5.23's recurrent kernel module (``is_kda=True``) and its KDA ReplaySSM commit."""
    return load_or_skip(engine_kernels.load_sglang)


@pytest.fixture(scope="module")
def vllm():
    """vLLM 0.34.0's KDA recurrent kernel module (its chain speculative path)."""
    return load_or_skip(engine_kernels.load_vllm_kda)


H, K, V = 2, 16, 16


def _layer(T_total: int, seed: int, dtype: torch.dtype = torch.float32):
    """One layer's verify inputs as SGLang hands them over: q, k, v strided views of one packed
    projection ``[1, Ttot, ...]``, raw gate inputs ``a [Ttot, H * K]``, ``b [Ttot, H]`` (in
    ``dtype``), ``A_log [H]``, ``dt_bias [H * K]`` (float32); on :data:`DEV`."""
    gen = torch.Generator().manual_seed(seed)
    mixed = torch.randn(T_total, 2 * H * K + H * V, generator=gen).to(dtype).to(DEV)
    q, k, v = torch.split(mixed, [H * K, H * K, H * V], dim=-1)
    q, k, v = q.view(1, T_total, H, K), k.view(1, T_total, H, K), v.view(1, T_total, H, V)
    a = torch.randn(T_total, H * K, generator=gen).to(dtype)
    b = torch.randn(T_total, H, generator=gen).to(dtype)
    A_log = torch.rand(H, generator=gen) * 2 - 1
    dt_bias = torch.randn(H * K, generator=gen) * 0.5
    return dict(A_log=A_log.to(DEV), a=a.to(DEV), dt_bias=dt_bias.to(DEV), q=q, k=k, v=v, b=b.to(DEV))


def _pool(slots: int, seed: int) -> torch.Tensor:
    """A state pool ``[slots, H, V, K]`` float32 of states of a decoded sequence's size, on
    :data:`DEV`."""
    return (torch.randn(slots, H, V, K, generator=torch.Generator().manual_seed(seed)) * 0.3).to(DEV)


def _specla(layer, pool, cache_indices, row_indices, qsl, steps, parents, paths, rows):
    """specla's verify and commit on the pool (a copy); returns ``o`` and the pool after the
    commit, and checks that the verify left the pool bit-identical."""
    pool = pool.clone()
    before = pool.clone()
    records = empty_record_buffers(rows, steps, H, K, V, DEV)
    o = kda_pool_verify(softplus_beta=1.0, softplus_threshold=20.0, initial_state_source=pool,
                        initial_state_indices=cache_indices, use_qk_l2norm_in_kernel=True, cu_seqlens=qsl,
                        records=records, intermediate_state_indices=row_indices, cache_steps=steps,
                        retrieve_parent_token=parents, **layer)
    assert torch.equal(pool, before)  # the verify reads the pool only
    accept_index, accept_lens = accepted_positions(paths, steps, steps)
    kda_pool_commit(pool, cache_indices, records, row_indices, accept_index, accept_lens, steps)
    return o, pool


@pytest.mark.parametrize("prepare", ["fused", "separate"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_verify_and_commit_equal_sglang_per_node_snapshots(sglang, dtype, prepare, monkeypatch):
    """Ragged 6-node trees (a different shape a row), a row whose root alone is accepted and a
    path ending inside its tree: specla's outputs and committed states against SGLang's KDA tree
    verify and its snapshot commit, activations in float32 or bfloat16 (states float32), with
    either form of the tree kernel's substitution matrices (``TUNING["tree"]["prepare"]``)."""
    monkeypatch.setitem(kda_verify.TUNING, "tree", {**kda_verify.TUNING["tree"], "prepare": prepare})
    D, N, slots = 6, 4, 7
    trees = [[-1, 0, 0, 1, 1, 2], [-1, 0, 1, 2, 3, 4], [-1, 0, 0, 0, 0, 0], [-1, 0, 1, 1, 3, 3]]
    leaves = [4, 5, 0, 5]  # row 2: the root alone is accepted
    paths = [root_path(t, leaf) for t, leaf in zip(trees, leaves)]
    paths[3] = paths[3][:2]
    layer = _layer(N * D, seed=0, dtype=dtype)
    pool = _pool(slots, seed=1)
    cache_indices = torch.tensor([5, 0, 3, 6], dtype=torch.int32, device=DEV)
    row_indices = torch.tensor([2, 0, 3, 1], dtype=torch.int32, device=DEV)  # record / scratch row of each request
    qsl = torch.arange(0, N * D + 1, D, dtype=torch.int32, device=DEV)
    parents = torch.tensor(trees, dtype=torch.int64, device=DEV)

    ref_pool = pool.clone()
    scratch = torch.zeros(N, D, H, V, K, device=DEV)
    o_ref = sglang.recurrent.fused_sigmoid_gating_delta_rule_update(
        softplus_beta=1.0, softplus_threshold=20.0, initial_state_source=ref_pool, initial_state_indices=cache_indices,
        cu_seqlens=qsl, use_qk_l2norm_in_kernel=True, is_kda=True, disable_state_update=True,
        intermediate_states_buffer=scratch, intermediate_state_indices=row_indices, cache_steps=D,
        retrieve_parent_token=parents, **layer)
    assert torch.equal(ref_pool, pool)
    for n, p in enumerate(paths):  # SGLang's commit: the last accepted node's snapshot into the slot
        ref_pool[cache_indices[n]] = scratch[row_indices[n], p[-1]]

    o, committed = _specla(layer, pool, cache_indices, row_indices, qsl, D, parents, paths, N)
    assert o.dtype == o_ref.dtype == dtype
    # float32: observed 4.5e-8 (outputs up to 0.23); bfloat16: observed equal, allowed one bf16 ulp
    tol = 1e-6 if dtype == torch.float32 else 2**-8 * o_ref.float().abs() + 1e-6
    assert ((o.float() - o_ref.float()).abs() <= tol).all()
    assert (committed - ref_pool).abs().max() < 2e-6  # observed 1.2e-7, 2.1e-7 in bf16 (states moved by 1.2)
    assert torch.equal(committed[[1, 2, 4]], pool[[1, 2, 4]])  # slots of no row: untouched


def _chains():
    """Packed chains of :data:`CHAIN_LENS` tokens (``cu_seqlens``), their layer inputs and pool."""
    qsl = chain_cu_seqlens()
    return qsl, _layer(int(qsl[-1]), seed=2), _pool(4, seed=3)


def _specla_chains(layer, pool, cache_indices, qsl):
    """specla's verify and commit of :func:`_chains`' rows (positions of row ``n`` offset by ``n
    * steps`` in ``accept_index``)."""
    steps = max(CHAIN_LENS)
    paths = [list(range(m)) for m in CHAIN_ACCEPTED]
    rows = torch.arange(len(CHAIN_LENS), dtype=torch.int64, device=DEV)
    return _specla(layer, pool, cache_indices, rows, qsl, steps, None, paths, len(CHAIN_LENS))


def test_chain_verify_and_commit_equal_vllm_per_position_slots(vllm):
    """vLLM's KDA chain speculative kernel writes the state after every position into its own
    slot (``ssm_state_indices [N, T]``) and reads the committed one from the slot of the last
    accepted position: specla's outputs and committed states against it, on ragged chains up to
    48 long."""
    qsl, layer, pool = _chains()
    N, T = len(CHAIN_LENS), max(CHAIN_LENS)
    cache_indices = torch.tensor([2, 0, 3], dtype=torch.int32, device=DEV)
    # vLLM's pool: slot 0 is its null block; row n's positions take slots 1 + n * T + t
    vpool = torch.zeros(1 + N * T, H, V, K, device=DEV)
    slots = 1 + torch.arange(N * T, dtype=torch.int32, device=DEV).view(N, T)
    vpool[slots[:, 0].long()] = pool[cache_indices.long()]
    Ttot = int(qsl[-1])
    o_ref, _ = vllm.fused_recurrent_kda(
        q=layer["q"], k=layer["k"], v=layer["v"], raw_g=layer["a"].view(1, Ttot, H, K),
        raw_beta=layer["b"].view(1, Ttot, H), A_log=layer["A_log"], dt_bias=layer["dt_bias"], lower_bound=None,
        initial_state=vpool, cu_seqlens=qsl, ssm_state_indices=slots,
        num_accepted_tokens=torch.ones(N, dtype=torch.int32, device=DEV))

    o, committed = _specla_chains(layer, pool, cache_indices, qsl)
    assert (o - o_ref).abs().max() < 1e-6  # observed 1.0e-7
    ref = torch.stack([vpool[slots[n, m - 1]] for n, m in enumerate(CHAIN_ACCEPTED)])
    # observed 8.0e-7 on the 31-token path (states up to 0.9, moved by 1.4); against a float64 replay
    # of it specla's commit is off by 8.0e-7 and the engines' serial replay by 1.1e-7: the closed
    # form sums 31 float32 terms
    assert (committed[cache_indices.long()] - ref).abs().max() < 8e-6
    assert torch.equal(committed[1], pool[1])


def test_chain_verify_and_commit_equal_sglang_kda_replayssm(sglang):
    """SGLang's KDA compact-record chains (ReplaySSM): the verify writes each token's raw k, v,
    per-channel gate and beta into a per-slot ring, the commit replays the accepted prefix into
    the checkpoint state. specla's outputs and committed states against both."""
    qsl, layer, pool = _chains()
    L = max(CHAIN_LENS)
    cache_indices = torch.tensor([2, 0, 3], dtype=torch.int32, device=DEV)
    ref_pool = pool.clone()
    ring = dict(replayssm_rawv=torch.zeros(4, H, L, V, device=DEV),
                replayssm_rawk=torch.zeros(4, H, L, K, device=DEV),
                replayssm_g=torch.zeros(4, H, L, K, device=DEV), replayssm_beta=torch.zeros(4, H, L, device=DEV))
    o_ref = sglang.recurrent.fused_sigmoid_gating_delta_rule_update(
        softplus_beta=1.0, softplus_threshold=20.0, initial_state_source=ref_pool, initial_state_indices=cache_indices,
        cu_seqlens=qsl, use_qk_l2norm_in_kernel=True, is_kda=True, disable_state_update=True, cache_ring=True,
        **ring, **layer)
    assert torch.equal(ref_pool, pool)
    sglang.kda_fold.commit_kda_replayssm_spec(
        ref_pool, ring["replayssm_rawv"], ring["replayssm_rawk"], ring["replayssm_g"], ring["replayssm_beta"],
        cache_indices, torch.tensor(CHAIN_ACCEPTED, dtype=torch.int32, device=DEV), max_cache_len=L, num_k_heads=H,
        null_block_id=-1)  # SGLang's commit after verify passes -1: slot 0 is a request's

    o, committed = _specla_chains(layer, pool, cache_indices, qsl)
    assert (o - o_ref).abs().max() < 1e-6  # observed 1.0e-7
    assert (committed - ref_pool).abs().max() < 8e-6  # observed 8.0e-7 on the 31-token path, as against vLLM
    assert torch.equal(committed[1], pool[1])


def test_chains_run_the_serial_kernel_and_agree_with_the_tree_kernel(monkeypatch):
    """Chains (no ``retrieve_parent_token``) take the state-resident serial kernel, with its V
    tile split (8 of 16); the same rows given as chain-shaped trees take the tree kernel: outputs
    and records agree (a padding slot's row among them), record steps past a row's tokens stay
    unwritten (NaN), and a row with record row -1 writes none and outputs zeros, as the tree
    kernel's."""
    from specla.mixers.kda import serving, verify

    monkeypatch.setitem(verify.TUNING, "serial", {**verify.TUNING["serial"], "BV": 8})
    launched = []
    monkeypatch.setattr(serving, "_launch_serial", lambda *a, **k: launched.append(1) or verify._launch_serial(*a, **k))
    lens, steps = [5, 3, 7], 8
    qsl = chain_cu_seqlens(lens)
    N = len(lens)
    layer, pool = _layer(sum(lens), seed=14), _pool(4, seed=15)
    slots = torch.tensor([2, -1, 0], dtype=torch.int32, device=DEV)
    rows = torch.tensor([1, 3, -1], dtype=torch.int32, device=DEV)
    chain = torch.arange(-1, steps - 1, device=DEV).expand(N, steps)
    got = {}
    for name, parents in (("serial", None), ("tree", chain)):
        rec = empty_record_buffers(4, steps, H, K, V, DEV)
        for t in rec:
            t.fill_(float("nan"))
        o = kda_pool_verify(softplus_beta=1.0, softplus_threshold=20.0, initial_state_source=pool,
                            initial_state_indices=slots, use_qk_l2norm_in_kernel=True, cu_seqlens=qsl, records=rec,
                            intermediate_state_indices=rows, cache_steps=steps, retrieve_parent_token=parents,
                            **layer)
        got[name] = o, rec
    assert launched == [1]  # the chains' call, not the trees'
    (o, rec), (o_ref, rec_ref) = got["serial"], got["tree"]
    assert (o - o_ref).abs().max() < 3e-7  # observed 2.2e-8 (outputs up to 0.17)
    assert (o[0, -lens[-1]:] == 0).all()  # record row -1
    for row, m in zip(rows.tolist(), lens):
        if row >= 0:
            for field, ref in zip(rec, rec_ref):
                assert (field[row, :m] - ref[row, :m]).abs().max() < 3e-6  # observed 2.4e-7
                assert field[row, m:].isnan().all() and ref[row, m:].isnan().all()
    for field in rec:  # record rows 0 and 2 belong to no row
        assert field[[0, 2]].isnan().all()


def test_commit_of_every_layer_at_once_equals_each_layer_and_leaves_padding_alone():
    """Two layers' pools and records committed in one launch equal each layer's own commit; a row
    with a negative slot, or with no accepted node, writes nothing, while the other row commits."""
    steps, layers = 3, 2
    qsl = torch.tensor([0, 3, 5, 7], dtype=torch.int32, device=DEV)
    cache_indices = torch.tensor([2, -1, 3], dtype=torch.int32, device=DEV)
    rows = torch.arange(3, dtype=torch.int32, device=DEV)
    pools = torch.stack([_pool(4, seed=5 + i) for i in range(layers)])
    records = empty_record_buffers(3, steps, H, K, V, DEV, layers=(layers,))
    for i in range(layers):
        kda_pool_verify(**_layer(7, seed=4 + i), softplus_beta=1.0, softplus_threshold=20.0,
                        initial_state_source=pools[i], initial_state_indices=cache_indices,
                        use_qk_l2norm_in_kernel=True, cu_seqlens=qsl, records=records.layer(i),
                        intermediate_state_indices=rows)
    accept_index, _ = accepted_positions([[0, 1, 2], [0, 1], [0, 1]], steps, steps)
    accept_lens = torch.tensor([3, 2, 0], device=DEV)
    each = pools.clone()
    for i in range(layers):
        kda_pool_commit(each[i], cache_indices, records.layer(i), rows, accept_index, accept_lens, steps)
    every = pools.clone()
    kda_pool_commit(every, cache_indices, records, rows, accept_index, accept_lens, steps)
    assert torch.equal(every, each)
    assert torch.equal(every[:, [0, 1, 3]], pools[:, [0, 1, 3]])  # slot -1's row and slot 3's empty path
    assert not torch.equal(every[:, 2], pools[:, 2])


def test_pool_entry_points_reject_bad_input_clearly():
    qsl, layer, pool = _chains()
    cache_indices = torch.tensor([2, 0, 3], dtype=torch.int32, device=DEV)
    records = empty_record_buffers(3, max(CHAIN_LENS), H, K, V, DEV)
    rows = torch.arange(3, dtype=torch.int32, device=DEV)
    on = re.escape(str(pool.device))  # as the messages name it (cuda:0, not cuda)
    call = dict(softplus_beta=1.0, softplus_threshold=20.0, initial_state_source=pool,
                initial_state_indices=cache_indices, cu_seqlens=qsl, records=records,
                intermediate_state_indices=rows, **layer)
    with pytest.raises(ValueError, match=r"^initial_state_source must be float32 \[slots, 2, 16, 16\] \(V before K\), "
                                         r"got torch.float64 \[4, 2, 16, 16\]$"):
        kda_pool_verify(**call | dict(initial_state_source=pool.double()))
    with pytest.raises(ValueError, match=r"^a must be \[tokens, 32\] and b \[tokens, 2\] of the 56 tokens, got "
                                         r"\[56, 2\], \[56, 2\]$"):
        kda_pool_verify(**call | dict(a=layer["b"]))
    with pytest.raises(ValueError, match=r"^A_log and dt_bias must be contiguous with 2 and 32 elements, got "
                                         r"\[2\], \[2\]$"):
        kda_pool_verify(**call | dict(dt_bias=layer["A_log"]))
    with pytest.raises(ValueError, match=r"^records must be KDARecordBuffers, got tuple$"):
        kda_pool_verify(**call | dict(records=tuple(records)))
    bad = KDARecordBuffers(records.k, records.delta, records.Gk.to(torch.bfloat16))
    with pytest.raises(ValueError, match=rf"^records.Gk must be float32 \[3, 48, 2, 16\] on {on}, contiguous, got "
                                         rf"torch.bfloat16 \[3, 48, 2, 16\] on {on}$"):
        kda_pool_verify(**call | dict(records=bad))
    with pytest.raises(ValueError, match=rf"^accept_index must be int32 or int64 \[3, P\] on {on}, "
                                         r"got torch.int64 \[3\]$"):
        kda_pool_commit(pool, cache_indices, records, rows, torch.zeros(3, dtype=torch.int64, device=DEV),
                        torch.ones(3, dtype=torch.int64, device=DEV), 48)


class TinyKDAModel:
    """A two-layer KDA language model of random weights (vocabulary 5, width 32, no short conv,
    which the engine keeps outside the recurrent kernels): ``h += kda(q, k, v, a, b) W_o`` a
    layer, ``kda`` being the caller's kernel call on its state pool of that layer. Its weights are
    on :data:`DEV`."""

    vocab, width, layers = 5, 32, 2

    def __init__(self, seed: int):
        gen = torch.Generator().manual_seed(seed)
        r = lambda *s, scale=1.0: (torch.randn(*s, generator=gen) * scale).to(DEV)  # noqa: E731
        d = self.width
        self.emb = r(self.vocab, d)
        self.lm = r(d, self.vocab, scale=d**-0.5)
        self.w = [dict(qkv=r(d, 2 * H * K + H * V, scale=d**-0.5), a=r(d, H * K, scale=d**-0.5),
                       b=r(d, H, scale=d**-0.5), out=r(H * V, d, scale=(H * V) ** -0.5),
                       A_log=r(H, scale=0.5), dt_bias=r(H * K, scale=0.5)) for _ in range(self.layers)]

    def logits(self, tokens: torch.Tensor, kda) -> torch.Tensor:
        """``[Ttot, vocab]`` of packed ``tokens [Ttot]``; ``kda(layer, A_log, a, dt_bias, q, k, v,
        b) -> o [1, Ttot, H, V]``, q, k, v strided views of one projection as SGLang's."""
        h = self.emb[tokens]
        T = tokens.shape[0]
        for i, w in enumerate(self.w):
            q, k, v = torch.split(h @ w["qkv"], [H * K, H * K, H * V], dim=-1)
            o = kda(i, w["A_log"], h @ w["a"], w["dt_bias"], q.view(1, T, H, K), k.view(1, T, H, K),
                    v.view(1, T, H, V), h @ w["b"])
            h = h + o.reshape(T, H * V) @ w["out"]
        return h @ self.lm


def _plain_step(model, sglang, pools, cache_indices, tokens):
    """One token a row through SGLang's own KDA decode call (states updated in place)."""
    qsl = torch.arange(tokens.shape[0] + 1, dtype=torch.int32, device=DEV)

    def kda(i, A_log, a, dt_bias, q, k, v, b):
        return sglang.recurrent.fused_sigmoid_gating_delta_rule_update(
            A_log=A_log, a=a, dt_bias=dt_bias, softplus_beta=1.0, softplus_threshold=20.0, q=q, k=k, v=v, b=b,
            initial_state_source=pools[i], initial_state_indices=cache_indices, cu_seqlens=qsl,
            use_qk_l2norm_in_kernel=True, is_kda=True)

    return model.logits(tokens, kda)


def test_tree_speculation_through_a_small_model_is_token_identical_to_the_engines_plain_decoding(sglang):
    """Greedy decoding of a small random KDA model, two rows in state slots 3 and 1: plain, one
    token a step through SGLang's KDA decode kernel, against speculation on random draft trees (6
    and 4 nodes, root included) through ``kda_pool_verify`` and ``kda_pool_commit`` (every layer
    in one launch). The drafter knows part of the answer (a random-depth branch of the plain
    tokens, the other branches wrong), so steps accept from nothing to a whole branch. Tokens
    must be identical."""
    model, new = TinyKDAModel(seed=6), 12
    prompts = torch.tensor([[1, 4, 2, 0], [3, 3, 1, 2]], device=DEV)
    N, slots, sizes = 2, 5, [6, 4]
    cache_indices = torch.tensor([3, 1], dtype=torch.int32, device=DEV)

    pools = [torch.zeros(slots, H, V, K, device=DEV) for _ in range(model.layers)]
    plain = plain_decode(lambda tokens: _plain_step(model, sglang, pools, cache_indices, tokens), prompts, new)

    pools = torch.zeros(model.layers, slots, H, V, K, device=DEV)  # every layer's pool, committed in one launch
    for t in range(prompts.shape[1] - 1):  # the prompt but its last token, which roots the first tree
        _plain_step(model, sglang, pools, cache_indices, prompts[:, t])
    rows = torch.tensor([1, 0], dtype=torch.int32, device=DEV)
    records = empty_record_buffers(N, max(sizes), H, K, V, DEV, layers=(model.layers,))
    width = max(sizes)

    def verify(toks, qsl, parents):
        def kda(i, A_log, a, dt_bias, q, k, v, b):
            return kda_pool_verify(A_log, a, dt_bias, 1.0, 20.0, q, k, v, b, pools[i], cache_indices,
                                   use_qk_l2norm_in_kernel=True, cu_seqlens=qsl, records=records.layer(i),
                                   intermediate_state_indices=rows, cache_steps=width,
                                   retrieve_parent_token=parents)

        return model.logits(torch.tensor(toks, device=DEV), kda).argmax(-1).tolist()

    def commit(paths):
        accept_index, accept_lens = accepted_positions(paths, width, width)
        kda_pool_commit(pools, cache_indices, records, rows, accept_index, accept_lens, width)

    out, accepted = speculate(plain, prompts[:, -1].tolist(), sizes, model.vocab, 7, verify, commit)
    assert [o[:new] for o in out] == plain
    assert 0 in accepted and max(accepted) >= 3  # steps accepting nothing, and deep ones
