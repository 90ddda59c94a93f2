"""FLA's hybrid configurations (the ``attn`` option: softmax-attention layers beside the recurrent
ones) through the gdn and gla plugins: the attention layers run on specla's tree attention
(:mod:`specla_fla.attention`). The oracle is FLA's own forward (its projections, rotary
embedding, norms and recurrent kernels, interpreted on the CPU by ``tests/fla_oracle.py``) with
only flash-attn's kernel, which is not installed here, replaced by
``F.scaled_dot_product_attention`` under the same causal and sliding-window mask."""

import pytest
import torch
import torch.nn.functional as F

import specla
from specla_fla.attention import without_flash_attn
from specla.registry import get_plugin
from specla.testing.drafters import OracleDrafter
import transformers_checks

PLUGINS = ["gdn", "gla"]


def sdpa_flash_attn(q, k, v, causal=True, window_size=(-1, -1), **_):
    """flash-attn's ``flash_attn_func`` for ``[B, T, H, Dh]`` inputs (grouped-query heads, causal,
    ``window_size=(left, 0)``: a query sees itself and ``left`` earlier keys), by SDPA."""
    assert causal and window_size[1] in (-1, 0)
    H, HK, T, S = q.shape[2], k.shape[2], q.shape[1], k.shape[1]
    k, v = (x.repeat_interleave(H // HK, 2).transpose(1, 2) for x in (k, v))
    i, j = torch.arange(T)[:, None] + S - T, torch.arange(S)[None]
    mask = (j <= i) & ((window_size[0] < 0) | (j >= i - window_size[0]))
    return F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask).transpose(1, 2)


def hybrid_model(plugin: str, window: int | None, seed: int = 4):
    """The plugin's tiny random float32 hybrid (``tiny_model("attn")``, decays spread) with its
    attention layer's sliding window set to ``window`` (FLA reads it at every forward)."""
    model = get_plugin(plugin).tiny_model("attn", seed=seed, dtype=torch.float32)
    for blk in model.model.layers:
        if type(blk.attn).__name__ == "Attention":
            blk.attn.window_size = window
    return model


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("plugin", PLUGINS)
def test_hybrid_decodes_like_flas_own_forward(plugin, window, monkeypatch):
    """Greedy decoding of FLA's own forward (no cache, the full sequence each step) equals
    specla's output with accepted tree drafts, for a ragged batch: the rotary embedding, the
    grouped-query heads, the biases and the sliding window are FLA's. The sequential twin the
    conformance suite uses agrees too."""
    from fla_oracle import enable_fla_interpreter, fla_greedy_generate
    import fla.layers.attn as fla_attn

    enable_fla_interpreter()
    arch, model = get_plugin(plugin), hybrid_model(plugin, window)
    monkeypatch.setattr(fla_attn, "flash_attn_func", sdpa_flash_attn)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 61, (n,), generator=g).tolist() for n in (1, 6)]
    refs = [fla_greedy_generate(model, p, 8) for p in prompts]
    assert refs == [arch.reference_decode(model, p, 8) for p in prompts]
    out = specla.run(model, prompts=prompts, drafter=OracleDrafter(prompts, refs, "tree", 61),
                     config=dict(max_new_tokens=8, num_draft_tokens=6, max_depth=4, top_k=2))
    assert out.outputs == refs and out.stats.mean_accepted_tokens > 1


@pytest.mark.parametrize("commit", ["factor", "snapshot", "replay"])
@pytest.mark.parametrize("plugin", PLUGINS)
def test_sliding_window_hybrid_equals_sequential_decoding_past_the_window(plugin, commit):
    """Prompts around the prefill chunk, far past a 5-token window, every commit strategy, tree
    drafts accepted, ``plugin=None``: outputs equal the sequential twin's greedy decoding."""
    arch, model = get_plugin(plugin), hybrid_model(plugin, 5, seed=6)
    prompts = transformers_checks.prompts_around_the_prefill_chunk(3, 61, (2, 63, 65))
    refs = [arch.reference_decode(model, p, 10) for p in prompts]
    out = specla.run(model, prompts=prompts, drafter=OracleDrafter(prompts, refs, "tree", 61),
                     config=dict(max_new_tokens=10, num_draft_tokens=6, max_depth=4, top_k=2,
                                 engine=dict(commit=commit)))
    assert out.outputs == refs and out.stats.mean_accepted_tokens > 1


@pytest.mark.skipif(not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") != "1",
                    reason="FLA's and the gdn plugin's Triton kernels need a GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("window", [None, 5])
def test_whole_prompt_prefill_of_a_gdn_hybrid_equals_sequential_decoding(window, monkeypatch):
    """``prefill="chunked"`` on FLA's GDN hybrid: the GDN layers through FLA's chunked kernel, the
    attention layers causal over whole prompts (the sliding window as a mask), prompts around the
    prefill chunk and past the window, tree drafts accepted: outputs equal the sequential twin's
    greedy decoding (which equals FLA's own forward, above)."""
    from fla_oracle import whole_prompt_prefill_calls

    calls = whole_prompt_prefill_calls(monkeypatch)
    arch, model = get_plugin("gdn"), hybrid_model("gdn", window, seed=6)
    prompts = transformers_checks.prompts_around_the_prefill_chunk(3, 61, (2, 66, 9))
    refs = [arch.reference_decode(model, p, 8) for p in prompts]
    out = specla.run(model, prompts=prompts, drafter=OracleDrafter(prompts, refs, "tree", 61),
                     config=dict(max_new_tokens=8, num_draft_tokens=6, max_depth=4, top_k=2,
                                 engine=dict(kernels="triton", cuda_graphs="off", prefill="chunked"),
                                 device="cuda" if torch.cuda.is_available() else "cpu"))
    assert calls and out.outputs == refs and out.stats.mean_accepted_tokens > 1


def test_a_gla_hybrid_checkpoint_directory_runs_unchanged_without_flash_attn(tmp_path):
    """``save_pretrained`` of a GLA hybrid at FLA's ``gate_logit_normalizer`` (16: its config does
    not save the tiny model's 4, so the conformance suite's checkpoint test is a known failure of
    the gla plugin) and ``specla.run`` on the directory with ``plugin=None``: FLA builds the
    attention layers (flash-attn is not installed) and the output is the twin's greedy decoding
    of the saved model. The gdn plugin's hybrid runs the suite's checkpoint test."""
    from specla.registry import detect_plugin

    arch = get_plugin("gla")
    model = arch.tiny_model("attn", seed=5, dtype=torch.float32)
    for blk in model.model.layers:  # FLA's default, what a GLA layer is built with from its config
        if hasattr(blk.attn, "gate_logit_normalizer"):
            blk.attn.gate_logit_normalizer = 16
    model.save_pretrained(tmp_path)
    assert detect_plugin(str(tmp_path)) is arch
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    out = specla.run(str(tmp_path), prompts=[prompt], config=dict(max_new_tokens=8))
    assert out.outputs == [arch.reference_decode(model, prompt, 8)]


def test_flash_attn_stand_in_is_scoped_and_names_the_reason():
    """While FLA builds a model for specla, its attention kernel is a stand-in that raises a
    clear error if called; afterwards FLA's module is as it was."""
    import fla.layers.attn as fla_attn

    if fla_attn.flash_attn_func is not None:
        pytest.skip("flash-attn is installed")
    with without_flash_attn():
        with pytest.raises(RuntimeError, match="built by specla without flash-attn"):
            fla_attn.flash_attn_func(None, None, None)
        model = get_plugin("gdn").tiny_model("attn", dtype=torch.float32)  # nested use (the plugin's own)
    assert fla_attn.flash_attn_func is None
    assert type(model.model.layers[1].attn).__name__ == "Attention"


def test_hybrid_score_is_teacher_forced_decoding():
    """``score`` (used to train drafters) over a GDN hybrid (the plugin's whole-sequence form
    gives way to the chunked pass): every position's logits equal the sequential twin's after
    the same tokens, float64."""
    from specla_fla.oracle import NaiveGDN

    model = get_plugin("gdn").tiny_model("attn", seed=3, dtype=torch.float64)
    tokens = torch.randint(0, 61, (1, 70), generator=torch.Generator().manual_seed(1))
    ad = specla.SpecDecoder(model, "gdn", config=dict(dtype="float64")).adapter
    logits = ad.score(tokens)
    twin = NaiveGDN(model)
    want = torch.stack([twin.step(int(t)) for t in tokens[0]])
    torch.testing.assert_close(logits[0], want, rtol=1e-9, atol=1e-9)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("plugin", PLUGINS)
def test_cuda_hybrid_kernels_and_graphs_equal_sequential_decoding(plugin):
    """On a GPU: the recurrent layers on the Triton kernels, recorded CUDA-graph steps, float32,
    accepted tree drafts, a ragged batch: outputs equal the sequential twin's."""
    arch = get_plugin(plugin)
    model = arch.tiny_model("attn", seed=2, dtype=torch.float32)
    prompts = transformers_checks.prompts_around_the_prefill_chunk(8, 61)
    refs = [arch.reference_decode(model, p, 12) for p in prompts]  # the twins run on the CPU
    dec = specla.SpecDecoder(model.cuda(), plugin, drafter=OracleDrafter(prompts, refs, "tree", 61),
                             # fixed: every step drafts, and acceptance is asserted
                             config=dict(max_new_tokens=12, num_draft_tokens=6, max_depth=4, top_k=2,
                                         engine=dict(cuda_graphs="on", budget_policy="fixed")))
    out = dec.generate(prompts)
    assert out.outputs == refs and out.stats.mean_accepted_tokens > 1
    assert dec.engine._runner.graphs and dec.adapter._use_kernel("factor")
