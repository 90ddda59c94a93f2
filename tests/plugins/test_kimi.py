"""The kimi_linear plugin against transformers' own ``KimiLinearForCausalLM``: the KDA tree
recurrence against transformers' per-token recurrence along every root path, token identity with
transformers' greedy decoding, checkpoints loaded unchanged, unsupported models refused by name."""

import random

import pytest
import torch

from specla.errors import UnsupportedModelError
from specla.ops.naive import root_path
from specla.registry import get_plugin

import transformers_checks
from trees import DEV, SHAPES, needs_triton, tree_parents

ARCH = get_plugin("kimi_linear")
V = 41


@pytest.mark.parametrize("shape", SHAPES)
def test_kda_tree_and_commit_equal_transformers_recurrence_along_each_path(shape):
    """Float64, random inputs (raw q and k; per-channel decays), a batch of two trees of shape
    ``shape``: every node's output and state equal transformers' ``recurrent_kimi_delta_attention``
    (its PyTorch function) run over the node's root path from the committed state, and
    ``kda_commit_replay`` along a path gives the state after its last node, and leaves a row with nothing
    accepted bit-identical."""
    from transformers.models.kimi_linear import modeling_kimi_linear as mk

    from specla.mixers.kda.naive import kda_commit_replay, kda_tree

    recurrent = getattr(mk.recurrent_kimi_delta_attention, "__wrapped__", mk.recurrent_kimi_delta_attention)
    rng, g = random.Random(7), torch.Generator().manual_seed(7)
    B, H, K, Vd = 2, 2, 4, 3
    parents = torch.tensor([tree_parents(shape, 9, rng) for _ in range(B)])
    T = parents.shape[1]
    q, k = torch.randn(B, T, H, K, generator=g, dtype=torch.float64), torch.randn(B, T, H, K, generator=g, dtype=torch.float64)
    v = torch.randn(B, T, H, Vd, generator=g, dtype=torch.float64)
    gk = -torch.rand(B, T, H, K, generator=g, dtype=torch.float64)  # log decay in (-1, 0]
    beta = torch.rand(B, T, H, generator=g, dtype=torch.float64)
    S0 = torch.randn(B, H, K, Vd, generator=g, dtype=torch.float64)
    qn = mk.l2norm(q, dim=-1, eps=1e-6) * K**-0.5
    kn = mk.l2norm(k, dim=-1, eps=1e-6)
    o, states, _ = kda_tree(qn, kn, v, gk, beta, S0, parents)
    for b in range(B):
        for t in range(T):
            idx = root_path(parents[b].tolist(), t)
            want_o, want_S = recurrent(q[b:b + 1, idx].float(), k[b:b + 1, idx].float(), v[b:b + 1, idx].float(),
                                       g=gk[b:b + 1, idx].float(), beta=beta[b:b + 1, idx].float(),
                                       initial_state=S0[b:b + 1].float(), output_final_state=True,
                                       use_qk_l2norm_in_kernel=True)
            # transformers computes in float32: compare at float32 precision
            torch.testing.assert_close(o[b, t].float(), want_o[0, -1], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(states[b, t].float(), want_S[0], rtol=1e-5, atol=1e-6)
            path = torch.full((B, T), -1)
            path[b, : len(idx)] = torch.tensor(idx)
            path_len = torch.zeros(B, dtype=torch.int64)
            path_len[b] = len(idx)
            S = kda_commit_replay(S0, kn, v, gk, beta, path, path_len)
            torch.testing.assert_close(S[b], states[b, t], rtol=1e-12, atol=1e-12)
            assert torch.equal(S[1 - b], S0[1 - b])  # nothing accepted: bit-identical


def kda_inputs(B, T, H, K, Vd, seed, dtype=torch.float64):
    """Fresh random KDA inputs: q, k L2-normalised (q scaled), v, per-channel log decays in
    (-1, 0], beta in (0, 1), a random committed state."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    q, k = torch.nn.functional.normalize(r(B, T, H, K), dim=-1) * K**-0.5, torch.nn.functional.normalize(r(B, T, H, K), dim=-1)
    return (q, k, r(B, T, H, Vd), -torch.rand(B, T, H, K, generator=g, dtype=dtype),
            torch.rand(B, T, H, generator=g, dtype=dtype), r(B, H, K, Vd))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
def test_factorized_kda_and_its_factor_commit_equal_the_token_by_token_recurrence(shape, dtype, tol):
    """``tree_kda`` (one batched pass, no loop over nodes) on fresh random inputs and a batch of
    two trees of ``shape``: every node's output and delta equal the token-by-token twin along its
    root path; the snapshot states from the factors equal the twin's states; the closed-form
    ``kda_commit_factor`` of every node's root path equals the twin's state after that node and
    ``kda_commit_replay``; a row with nothing accepted keeps its state bit-identical."""
    from specla.tree import inclusive_ancestor_mask
    from specla.mixers.kda.naive import kda_commit_replay, kda_tree
    from specla.mixers.kda.reference import kda_commit_factor, kda_node_states, tree_kda

    rng = random.Random(11)
    B, H, K, Vd = 2, 3, 8, 5
    parents = torch.tensor([tree_parents(shape, 9, rng) for _ in range(B)])
    T = parents.shape[1]
    q, k, v, gk, beta, S0 = kda_inputs(B, T, H, K, Vd, seed=SHAPES.index(shape), dtype=dtype)
    mask = inclusive_ancestor_mask(parents)
    o, delta, Gk = tree_kda(q, k, v, gk, beta, S0, mask)
    want_o, want_states, want_delta = kda_tree(q, k, v, gk, beta, S0, parents)
    torch.testing.assert_close(o, want_o, rtol=tol, atol=tol)
    torch.testing.assert_close(delta, want_delta, rtol=tol, atol=tol)
    torch.testing.assert_close(kda_node_states(S0, k, delta, Gk, mask), want_states, rtol=tol, atol=tol)
    for t in range(T):
        path = torch.full((B, T), -1)
        idx = root_path(parents[0].tolist(), t)
        path[0, : len(idx)] = torch.tensor(idx)
        path_len = torch.tensor([len(idx), 0])
        S = kda_commit_factor(S0, k, delta, Gk, path, path_len)
        torch.testing.assert_close(S[0], want_states[0, t], rtol=tol, atol=tol)
        torch.testing.assert_close(S, kda_commit_replay(S0, k, v, gk, beta, path, path_len), rtol=tol, atol=tol)
        assert torch.equal(S[1], S0[1])


def test_mla_with_fewer_kv_heads_is_refused_by_name():
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    from specla_kimi.plugin import TINY_BASE, TINY_VARIANTS

    cfg = KimiLinearConfig(**{**TINY_BASE, **TINY_VARIANTS["base"], "num_key_value_heads": 2})
    with pytest.raises(UnsupportedModelError, match="num_key_value_heads != num_attention_heads"):
        ARCH.check_model(KimiLinearForCausalLM(cfg))


@needs_triton
@pytest.mark.parametrize("variant, graphs, verify_kernel", [("base", "off", "serial"), ("mla_first", "unrecorded", "auto")])
def test_the_kda_kernels_equal_transformers_greedy(variant, graphs, verify_kernel, monkeypatch):
    """``kernels="triton"`` (interpreted on a CPU): the KDA layers verify with specla's KDA
    kernels, the pending commit fused into them, eagerly and in the fixed-shape step; float32,
    accepted tree drafts: outputs equal transformers' greedy decoding, the recurrent states equal
    the PyTorch path's, and the tree kernel ran with and without a pending commit (a forced
    ``serial`` takes the serial kernel for the prompts' chain passes, the tree kernel for trees)."""
    import specla.mixers.kda.verify as kda_verify  # the mixer reads its kernels there at each call

    calls = {"serial": 0, "fused": 0, "plain": 0}

    def counting(fn, serial):
        def wrapped(*args, pending=None, **kw):
            calls["serial" if serial else "fused" if pending is not None else "plain"] += 1
            return fn(*args, pending=pending, **kw)
        return wrapped

    monkeypatch.setattr(kda_verify, "serial_verify", counting(kda_verify.serial_verify, True))
    monkeypatch.setattr(kda_verify, "tree_verify", counting(kda_verify.tree_verify, False))
    transformers_checks.check_kernels_equal_reference(ARCH, variant, graphs, V, verify_kernel)
    assert calls["fused"] > 0 and calls["plain"] > 0
    assert calls["serial"] > 0 or verify_kernel != "serial"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("variant", ARCH.tiny_variants)
def test_cuda_recorded_steps_equal_transformers_greedy(variant):
    """On a GPU, recorded CUDA-graph steps (specla's KDA kernels, the MLA mixer's tree attention,
    MoE experts on ``batched_mm``), float32, accepted tree drafts, a ragged batch: every output
    equals transformers' greedy decoding of the same model on the GPU."""
    transformers_checks.check_cuda_graphs_equal_transformers(ARCH, variant, V, 12)


@pytest.mark.skipif(not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") != "1",
                    reason="FLA's Triton kernels need a GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("variant", ["mla_first"])  # the MLA and KDA layers of both variants (one, for time)
def test_whole_prompt_prefill_equals_transformers_greedy(variant, monkeypatch):
    """``prefill="chunked"``: the KDA layers through FLA's chunked KDA, the MLA layers causal over
    the prompt in the latent space, in one pass for a ragged batch, then tree drafts: outputs
    equal transformers' greedy decoding."""
    transformers_checks.check_whole_prompt_prefill_equals_transformers(ARCH, variant, V, monkeypatch)


@needs_triton
def test_trees_over_the_kda_kernel_size_take_the_reference_path_after_a_flush(monkeypatch):
    """``kernels="triton"`` with a 65-node tree (64 drafts and the root, over ``tree_verify``'s
    64) after a step whose accepted drafts are pending: the KDA layers apply the pending commit
    with the flush kernel, then verify the tree on the PyTorch path; logits equal the reference
    adapter's (float32)."""
    import specla.mixers.kda.commit as kda_commit  # the mixer reads its kernels there at each call
    from specla import DraftTree, SpecConfig
    from specla.acceptance import accept_greedy

    flushes = []
    flush_commit = kda_commit.flush_commit
    monkeypatch.setattr(kda_commit, "flush_commit", lambda *a: flushes.append(1) or flush_commit(*a))
    model = ARCH.tiny_model("base", seed=2, dtype=torch.float32)
    rng = random.Random(9)
    t1 = DraftTree.from_lists([([4, 5, 6], [-1, 0, 1])], device=DEV)
    par = tree_parents("random", 64, rng)
    t2 = DraftTree.from_lists([([rng.randrange(V) for _ in par], par)], device=DEV)
    logits = {}
    for kernels in ("triton", "reference"):
        adapter = ARCH.make_adapter(model, SpecConfig(num_draft_tokens=64, max_depth=64, device=DEV,
                                                      engine={"kernels": kernels}))
        adapter.prefill([[1, 2, 3]])
        out = adapter.verify(t1)
        adapter.commit(t1, out, accept_greedy(t1, out.logits))
        assert adapter.pending is not None
        before = len(flushes)
        logits[kernels] = adapter.verify(t2).logits
        # with the kernels, each of the two KDA layers flushed the pending commit before verifying
        assert len(flushes) - before == (2 if kernels == "triton" else 0)
    torch.testing.assert_close(logits["triton"], logits["reference"], rtol=1e-4, atol=1e-5)
