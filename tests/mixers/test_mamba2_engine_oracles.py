"""specla's Mamba2 verify and commit on a serving engine's data (``specla.mixers.mamba2.serving``)
against the engines' own published Triton kernels, on ``engine_cases.DEV``: compiled on a CUDA
machine, under Triton's interpreter on the CPU.

The engines' kernel files come from the package registry at test time, at the pinned versions
(:mod:`specla.testing.engine_kernels`: downloaded once into a per-user cache, imported by file
with the package-level helpers they import stubbed; under Triton's interpreter their masks are
read as bool, :func:`~specla.testing.engine_kernels.interpreter_bool_masks`). Without network
the tests skip, saying so.

Oracles: SGLang 0.5.23's per-node tree verify (``selective_state_update`` with
``retrieve_parent_token`` and ``intermediate_states_buffer``, as ``MambaMixer2.forward`` calls it
under ``is_target_verify``; the committed state is the accepted node's snapshot, scattered into
the slot), and its one-token decode (plain decoding through a small model); vLLM 0.34.0's chain
speculative kernel (``selective_state_update`` with ``num_accepted_tokens``, one state slot per
draft position). vLLM's compact-record chains for Mamba2 (``use_replayssm``) are not an oracle
here: their decode runs a planned ring (``plan_replayssm_decode``, write positions, flushes)
whose setup is the engine's scheduler's. Tolerances: the largest errors observed (noted at each
assertion) with a margin of about 10x.
"""

from __future__ import annotations

import re

import pytest
import torch

from specla.mixers.mamba2.serving import (
    Mamba2RecordBuffers, empty_record_buffers, mamba2_pool_commit, mamba2_pool_verify,
)
from specla.ops.naive import root_path
from specla.testing import engine_kernels
from engine_cases import CHAIN_ACCEPTED, CHAIN_LENS, DEV, accepted_positions, chain_cu_seqlens, load_or_skip
from tree_speculation import plain_decode, speculate


@pytest.fixture(autouse=True)
def _bool_masks():
    with engine_kernels.interpreter_bool_masks():
        yield


@pytest.fixture(scope="module")
def sglang():
    """SGLang 0.5.23's Mamba2 ``selective_state_update`` module."""
    return load_or_skip(engine_kernels.load_sglang).mamba


@pytest.fixture(scope="module")
def vllm():
    """vLLM 0.34.0's Mamba2 ``selective_state_update`` module (its chain speculative path)."""
    return load_or_skip(engine_kernels.load_vllm_mamba2)


H, P, NG, NS = 4, 16, 2, 16


def _layer(T_total: int, seed: int, dtype: torch.dtype = torch.float32, lead: tuple = ()):
    """One layer's verify inputs as the engines hand them over: ``x``, ``B``, ``C`` strided views
    of one conv output, ``dt`` of the projection (token dims ``lead`` or ``[Ttot]``), in ``dtype``;
    ``A`` (negative), ``dt_bias``, ``D`` float32 ``[H]``; on :data:`DEV`."""
    gen = torch.Generator().manual_seed(seed)
    lead = lead or (T_total,)
    xbc = torch.randn(T_total, H * P + 2 * NG * NS, generator=gen).to(dtype).to(DEV)
    x, B, C = torch.split(xbc, [H * P, NG * NS, NG * NS], dim=-1)
    proj = torch.randn(T_total, H + 3, generator=gen).to(dtype).to(DEV)  # dt, a slice of a wider projection
    # Mamba2's initialisation: softplus(dt_bias) log-uniform in [1e-3, 0.1], A = -[1, 16]
    dt0 = 1e-3 * 100 ** torch.rand(H, generator=gen)
    return dict(x=x.view(*lead, H, P), B=B.view(*lead, NG, NS), C=C.view(*lead, NG, NS),
                dt=proj[:, :H].view(*lead, H), A=(-(16 ** torch.rand(H, generator=gen))).to(DEV),
                dt_bias=torch.log(torch.expm1(dt0)).to(DEV), D=torch.randn(H, generator=gen).to(DEV))


def _engine_args(layer: dict) -> dict:
    """``layer`` as both engines pass it: ``dt`` over ``P``, ``A`` over ``[P, Ns]``, ``dt_bias``
    and ``D`` over ``P``, expanded (stride 0)."""
    return dict(layer, dt=layer["dt"][..., None].expand(*layer["dt"].shape, P),
                A=layer["A"][:, None, None].expand(H, P, NS), dt_bias=layer["dt_bias"][:, None].expand(H, P),
                D=layer["D"][:, None].expand(H, P))


def _pool(slots: int, seed: int) -> torch.Tensor:
    """A state pool ``[slots, H, P, Ns]`` float32 of states of a decoded sequence's size, on
    :data:`DEV`."""
    return (torch.randn(slots, H, P, NS, generator=torch.Generator().manual_seed(seed)) * 0.3).to(DEV)


def _specla(layer, pool, cache_indices, row_indices, qsl, steps, parents, paths, rows):
    """specla's verify and commit on the pool (a copy), the engines' expanded arguments; returns
    ``y`` and the pool after the commit, and checks that the verify left the pool bit-identical."""
    pool = pool.clone()
    before = pool.clone()
    records = empty_record_buffers(rows, steps, H, P, NG, NS, DEV)
    y = mamba2_pool_verify(pool, dt_softplus=True, state_batch_indices=cache_indices, cu_seqlens=qsl,
                           records=records, intermediate_state_indices=row_indices, cache_steps=steps,
                           retrieve_parent_token=parents, **_engine_args(layer))
    assert torch.equal(pool, before)  # the verify reads the pool only
    accept_index, accept_lens = accepted_positions(paths, steps, steps)
    mamba2_pool_commit(pool, cache_indices, records, row_indices, accept_index, accept_lens, steps)
    return y, pool


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_verify_and_commit_equal_sglang_per_node_snapshots(sglang, dtype):
    """Ragged 6-node trees (a different shape a row), a row whose root alone is accepted, a path
    ending inside its tree, a padding row (slot -1): specla's outputs and committed states against
    SGLang's tree verify and its snapshot commit, activations in float32 or bfloat16 (states
    float32)."""
    T, N, slots = 6, 5, 7
    trees = [[-1, 0, 0, 1, 1, 2], [-1, 0, 1, 2, 3, 4], [-1, 0, 0, 0, 0, 0], [-1, 0, 1, 1, 3, 3], [-1, 0, 1, 2, 3, 4]]
    paths = [root_path(t, leaf) for t, leaf in zip(trees, [4, 5, 0, 5, 3])]
    paths[3] = paths[3][:2]  # a path ending inside the tree
    layer = _layer(N * T, seed=0, dtype=dtype, lead=(N, T))
    pool = _pool(slots, seed=1)
    cache_indices = torch.tensor([5, 0, 3, 6, -1], dtype=torch.int32, device=DEV)  # the last row: padding
    row_indices = torch.tensor([2, 0, 3, 1, 4], dtype=torch.int32, device=DEV)  # record / scratch row of each request
    parents = torch.tensor(trees, dtype=torch.int64, device=DEV)

    ref_pool = pool.clone()
    scratch = torch.zeros(N, T, H, P, NS, device=DEV)
    y_ref = torch.empty_like(layer["x"])
    sglang.selective_state_update(
        ref_pool, z=None, dt_softplus=True, state_batch_indices=cache_indices, out=y_ref, disable_state_update=True,
        intermediate_states_buffer=scratch, cache_steps=T, retrieve_parent_token=parents,
        intermediate_state_indices=row_indices, **_engine_args(layer))
    assert torch.equal(ref_pool, pool)
    for n, p in enumerate(paths[:-1]):  # SGLang's commit: the last accepted node's snapshot into the slot
        ref_pool[cache_indices[n]] = scratch[row_indices[n], p[-1]]

    y, committed = _specla(layer, pool, cache_indices, row_indices, None, T, parents, paths, N)
    assert y.dtype == y_ref.dtype == dtype
    # the padding row's outputs are not compared: SGLang's reads its parents' states from scratch
    # it never wrote for that row
    y, y_ref = y[:-1].float(), y_ref[:-1].float()
    # float32: observed 3.3e-6 (outputs up to 5.7); bfloat16: observed equal, allowed one bf16 ulp
    tol = 4e-5 if dtype == torch.float32 else 2**-8 * y_ref.abs() + 1e-6
    assert ((y - y_ref).abs() <= tol).all()
    assert (committed - ref_pool).abs().max() < 1e-5  # observed 1.1e-6, 8.3e-7 in bf16 (states moved by 0.43)
    assert torch.equal(committed[[1, 2, 4]], pool[[1, 2, 4]])  # slots of no row (the padding row's): untouched


def test_chain_verify_and_commit_equal_vllm_per_position_slots(vllm):
    """vLLM's chain speculative kernel writes the state after every position into its own slot
    (``state_batch_indices [N, T]``) and reads the committed one from the slot of the last
    accepted position: specla's outputs and committed states against it, on packed ragged chains
    up to 48 long."""
    qsl = chain_cu_seqlens()
    N, T = len(CHAIN_LENS), max(CHAIN_LENS)
    layer, pool = _layer(int(qsl[-1]), seed=2), _pool(4, seed=3)
    cache_indices = torch.tensor([2, 0, 3], dtype=torch.int32, device=DEV)
    # vLLM's pool: slot 0 is its null block; row n's positions take slots 1 + n * T + t
    vpool = torch.zeros(1 + N * T, H, P, NS, device=DEV)
    slots = 1 + torch.arange(N * T, dtype=torch.int32, device=DEV).view(N, T)
    vpool[slots[:, 0].long()] = pool[cache_indices.long()]
    y_ref = torch.empty_like(layer["x"])
    with vllm.override_ssm_config((16, 4)):  # its launch config, without a tuned-config lookup
        vllm.selective_state_update(
            vpool, dt_softplus=True, state_batch_indices=slots, dst_state_batch_indices=slots, out=y_ref,
            num_accepted_tokens=torch.ones(N, dtype=torch.int32, device=DEV), cu_seqlens=qsl, **_engine_args(layer))

    paths = [list(range(m)) for m in CHAIN_ACCEPTED]
    rows = torch.arange(N, dtype=torch.int64, device=DEV)
    y, committed = _specla(layer, pool, cache_indices, rows, qsl, T, None, paths, N)
    # observed 1.1e-5 (outputs up to 6.2), vLLM's own error: against float64, its outputs are off by
    # 1.1e-5 on the 48-token row, specla's by 1.4e-6
    assert (y - y_ref).abs().max() < 1.5e-4
    ref = torch.stack([vpool[slots[n, m - 1]] for n, m in enumerate(CHAIN_ACCEPTED)])
    assert (committed[cache_indices.long()] - ref).abs().max() < 1e-5  # observed 8.3e-7 (moved by 1.6)
    assert torch.equal(committed[1], pool[1])


@pytest.mark.parametrize("packed", [True, False])
def test_chains_run_the_serial_kernel_and_agree_with_the_tree_kernel(packed, monkeypatch):
    """Chains (no ``retrieve_parent_token``) take the state-resident serial kernel, with its P
    tile split (8 of 16); the same rows given as chain-shaped trees take the tree kernel: outputs
    and records agree (a padding slot's row among them), record steps past a row's tokens and a
    row with record row -1 stay unwritten (NaN)."""
    from specla.mixers.mamba2 import serving, verify

    monkeypatch.setitem(verify.TUNING, "serial", {**verify.TUNING["serial"], "BP": 8})
    launched = []
    monkeypatch.setattr(serving, "_launch_serial", lambda *a, **k: launched.append(1) or verify._launch_serial(*a, **k))
    lens, steps = ([5, 3, 7], 8) if packed else ([6, 6, 6], 6)
    qsl = chain_cu_seqlens(lens) if packed else None
    N = len(lens)
    layer, pool = _layer(sum(lens), seed=12, lead=() if packed else (N, steps)), _pool(4, seed=13)
    slots = torch.tensor([2, -1, 0], dtype=torch.int32, device=DEV)
    rows = torch.tensor([1, 3, -1], dtype=torch.int32, device=DEV)
    chain = torch.arange(-1, steps - 1, device=DEV).expand(N, steps)
    got = {}
    for name, parents in (("serial", None), ("tree", chain)):
        rec = empty_record_buffers(4, steps, H, P, NG, NS, DEV)
        for t in rec:
            t.fill_(float("nan"))
        y = mamba2_pool_verify(pool, dt_softplus=True, state_batch_indices=slots, cu_seqlens=qsl, records=rec,
                               intermediate_state_indices=rows, cache_steps=steps, retrieve_parent_token=parents,
                               **_engine_args(layer))
        got[name] = y, rec
    assert launched == [1]  # the chains' call, not the trees'
    (y, rec), (y_ref, rec_ref) = got["serial"], got["tree"]
    assert (y - y_ref).abs().max() < 1e-5  # observed 9.5e-7 (outputs up to 5.6)
    for n, (row, m) in enumerate(zip(rows.tolist(), lens)):
        for field, ref in zip(rec, rec_ref):
            if row >= 0:
                assert (field[row, :m] - ref[row, :m]).abs().max() < 1e-5  # observed 3e-8
                assert field[row, m:].isnan().all() and ref[row, m:].isnan().all()
    for field in rec:  # record rows 0 and 2 belong to no row
        assert field[[0, 2]].isnan().all()


def test_commit_leaves_padding_rows_and_empty_paths_alone():
    """A row with a negative slot, or with no accepted node, writes nothing; the other row
    commits (a change of the state is checked, not its value: the oracles above check those)."""
    steps = 3
    qsl = torch.tensor([0, 3, 5, 7], dtype=torch.int32, device=DEV)
    layer, pool = _layer(7, seed=4), _pool(4, seed=5)
    cache_indices = torch.tensor([2, -1, 3], dtype=torch.int32, device=DEV)
    records = empty_record_buffers(3, steps, H, P, NG, NS, DEV)
    rows = torch.arange(3, dtype=torch.int32, device=DEV)
    mamba2_pool_verify(pool, layer["x"], layer["dt"], layer["A"], layer["B"], layer["C"], layer["D"],
                       layer["dt_bias"], True, cache_indices, qsl, records=records, intermediate_state_indices=rows)
    committed = pool.clone()
    accept_index, _ = accepted_positions([[0, 1, 2], [0, 1], [0, 1]], steps, steps)
    mamba2_pool_commit(committed, cache_indices, records, rows, accept_index, torch.tensor([3, 2, 0], device=DEV),
                       steps)
    assert torch.equal(committed[[0, 1, 3]], pool[[0, 1, 3]])  # slot -1's row and slot 3's empty path
    assert not torch.equal(committed[2], pool[2])


def test_verify_writes_a_strided_out_in_place_and_takes_every_form_of_d():
    """``out`` may be a strided view (SGLang's preallocated output is one): it is written in
    place, equal to the returned output without it; ``D`` per head, its stride-0 expand and a
    materialised ``[H, P]`` give the same outputs."""
    qsl = torch.tensor([0, 3, 5], dtype=torch.int32, device=DEV)
    layer, pool = _layer(5, seed=10), _pool(3, seed=11)
    call = dict(state=pool, dt_softplus=True, state_batch_indices=torch.tensor([2, 0], device=DEV), cu_seqlens=qsl,
                records=empty_record_buffers(2, 3, H, P, NG, NS, DEV),
                intermediate_state_indices=torch.arange(2, device=DEV), **layer)
    y = mamba2_pool_verify(**call)
    wide = torch.full((5, H * P + 8), float("nan"), device=DEV)
    out = wide[:, 8:].view(5, H, P)
    assert mamba2_pool_verify(**call | dict(out=out)) is out
    assert torch.equal(out, y) and wide[:, :8].isnan().all()
    for D in (layer["D"][:, None].expand(H, P), layer["D"][:, None].repeat(1, P)):
        assert torch.equal(mamba2_pool_verify(**call | dict(D=D)), y)


def test_pool_entry_points_reject_bad_input_clearly():
    qsl = torch.tensor([0, 3, 5], dtype=torch.int32, device=DEV)
    layer, pool = _layer(5, seed=6), _pool(4, seed=7)
    cache_indices = torch.tensor([2, 0], dtype=torch.int32, device=DEV)
    records = empty_record_buffers(2, 4, H, P, NG, NS, DEV)
    rows = torch.arange(2, dtype=torch.int32, device=DEV)
    on = re.escape(str(pool.device))  # as the messages name it (cuda:0, not cuda)
    call = dict(state=pool, dt_softplus=True, state_batch_indices=cache_indices, cu_seqlens=qsl, records=records,
                intermediate_state_indices=rows, **layer)
    with pytest.raises(ValueError, match=r"^state must be float32 \[slots, 4, 16, 16\] \(P before N\), "
                                         r"got torch.float64 \[4, 4, 16, 16\]$"):
        mamba2_pool_verify(**call | dict(state=pool.double()))
    with pytest.raises(ValueError, match=r"^the step sizes take softplus \(dt_softplus=True\), got dt_softplus=False$"):
        mamba2_pool_verify(**call | dict(dt_softplus=False))
    with pytest.raises(ValueError, match=r"^A must be one value per head, or its expand over \[16, 16\] \(stride 0\), "
                                         r"got \[4, 16, 16\] of strides \[256, 16, 1\]$"):
        mamba2_pool_verify(**call | dict(A=torch.zeros(H, P, NS, device=DEV)))
    with pytest.raises(ValueError, match=r"^cache_steps must be at most the records' D = 4 and 64, got 5$"):
        mamba2_pool_verify(**call | dict(cache_steps=5))
    with pytest.raises(ValueError, match=r"^records must be Mamba2RecordBuffers, got tuple$"):
        mamba2_pool_verify(**call | dict(records=tuple(records)))
    bad = Mamba2RecordBuffers(records.Bm.to(torch.bfloat16), records.u, records.G)
    with pytest.raises(ValueError, match=rf"^records.Bm must be float32 \[2, 4, 2, 16\] on {on}, contiguous, got "
                                         rf"torch.bfloat16 \[2, 4, 2, 16\] on {on}$"):
        mamba2_pool_verify(**call | dict(records=bad))
    with pytest.raises(ValueError, match=rf"^state_batch_indices must be int32 or int64 \[2\] on {on}, got "
                                         r"torch.int32 \[1\]$"):
        mamba2_pool_verify(**call | dict(state_batch_indices=cache_indices[:1]))
    with pytest.raises(ValueError, match=rf"^accept_index must be int32 or int64 \[2, P\] on {on}, "
                                         r"got torch.int64 \[2\]$"):
        mamba2_pool_commit(pool, cache_indices, records, rows, torch.zeros(2, dtype=torch.int64, device=DEV),
                           torch.ones(2, dtype=torch.int64, device=DEV), 4)


class TinyMamba2Model:
    """A two-layer Mamba2 language model of random weights (vocabulary 5, width 32; no short conv
    and no gated norm, which the engines run outside the SSM kernel): ``h += ssm(x, dt, B, C) W_o``
    a layer, ``ssm`` being the caller's kernel call on its state pool ``pools[layer]``. Its weights
    are on :data:`DEV`."""

    vocab, width, layers = 5, 32, 2

    def __init__(self, seed: int):
        gen = torch.Generator().manual_seed(seed)
        r = lambda *s, scale=1.0: (torch.randn(*s, generator=gen) * scale).to(DEV)  # noqa: E731
        d = self.width
        self.emb = r(self.vocab, d)
        self.lm = r(d, self.vocab, scale=d**-0.5)
        self.w = []
        for _ in range(self.layers):
            layer = _layer(1, seed=int(torch.randint(0, 2**31, (1,), generator=gen)))
            self.w.append(dict(xbc=r(d, H * P + 2 * NG * NS, scale=d**-0.5), dt=r(d, H, scale=d**-0.5),
                               out=r(H * P, d, scale=(H * P) ** -0.5),
                               **{k: layer[k] for k in ("A", "dt_bias", "D")}))

    def logits(self, tokens: torch.Tensor, ssm) -> torch.Tensor:
        """``[Ttot, vocab]`` of packed ``tokens [Ttot]``; ``ssm(layer, x [Ttot, H, P], dt [Ttot, H],
        B, C [Ttot, NG, Ns], A, dt_bias, D) -> y [Ttot, H, P]``, x, B, C strided views of one
        projection as the engines'."""
        h = self.emb[tokens]
        T = tokens.shape[0]
        for i, w in enumerate(self.w):
            x, B, C = torch.split(h @ w["xbc"], [H * P, NG * NS, NG * NS], dim=-1)
            y = ssm(i, x.view(T, H, P), h @ w["dt"], B.view(T, NG, NS), C.view(T, NG, NS), w["A"], w["dt_bias"],
                    w["D"])
            h = h + y.reshape(T, H * P) @ w["out"]
        return h @ self.lm


def _plain_step(model, sglang, pools, cache_indices, tokens):
    """One token a row through SGLang's own decode kernel (states updated in place)."""

    def ssm(i, x, dt, B, C, A, dt_bias, D):
        y = torch.empty_like(x)
        sglang.selective_state_update(pools[i], z=None, dt_softplus=True, state_batch_indices=cache_indices, out=y,
                                      **_engine_args(dict(x=x, dt=dt, B=B, C=C, A=A, dt_bias=dt_bias, D=D)))
        return y

    return model.logits(tokens, ssm)


def test_tree_speculation_through_a_small_model_is_token_identical_to_the_engines_plain_decoding(sglang):
    """Greedy decoding of a small random Mamba2 model, two rows in state slots 3 and 1: plain, one
    token a step through SGLang's decode kernel, against speculation on ragged random draft trees
    (6 and 4 nodes, root included, packed) through ``mamba2_pool_verify`` and
    ``mamba2_pool_commit`` (every layer in one launch). Tokens must be identical."""
    model, new = TinyMamba2Model(seed=8), 12
    prompts = torch.tensor([[1, 4, 2, 0], [3, 3, 1, 2]], device=DEV)
    N, slots, sizes = 2, 5, [6, 4]
    cache_indices = torch.tensor([3, 1], dtype=torch.int32, device=DEV)

    pools = [torch.zeros(slots, H, P, NS, device=DEV) for _ in range(model.layers)]
    plain = plain_decode(lambda tokens: _plain_step(model, sglang, pools, cache_indices, tokens), prompts, new)

    pools = torch.zeros(model.layers, slots, H, P, NS, device=DEV)  # every layer's pool, committed in one launch
    for t in range(prompts.shape[1] - 1):  # the prompt but its last token, which roots the first tree
        _plain_step(model, sglang, pools, cache_indices, prompts[:, t])
    rows, width = torch.tensor([1, 0], dtype=torch.int32, device=DEV), max(sizes)
    records = Mamba2RecordBuffers(*(torch.empty(model.layers, *r.shape, device=DEV) for r in
                                    empty_record_buffers(N, width, H, P, NG, NS, DEV)))

    def verify(toks, qsl, parents):
        def ssm(i, x, dt, B, C, A, dt_bias, D):
            return mamba2_pool_verify(pools[i], x, dt, A, B, C, D, dt_bias, True, cache_indices, qsl,
                                      records=records.layer(i), intermediate_state_indices=rows, cache_steps=width,
                                      retrieve_parent_token=parents)

        return model.logits(torch.tensor(toks, device=DEV), ssm).argmax(-1).tolist()

    def commit(paths):
        accept_index, accept_lens = accepted_positions(paths, width, width)
        mamba2_pool_commit(pools, cache_indices, records, rows, accept_index, accept_lens, width)

    out, accepted = speculate(plain, prompts[:, -1].tolist(), sizes, model.vocab, 9, verify, commit)
    assert [o[:new] for o in out] == plain
    assert 0 in accepted and max(accepted) >= 3  # steps accepting nothing, and deep ones
