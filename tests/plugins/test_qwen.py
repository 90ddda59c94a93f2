"""The qwen plugin against transformers' own Qwen3.5 classes: token identity with their greedy
decoding (no-cache forwards on the PyTorch path), checkpoints and multimodal models loaded
unchanged, the KV cache's limits."""

import pytest
import torch

import specla
from specla import SpecConfig, SpecDecoder
from specla.errors import SpecError
from specla.records import Acceptance
from specla.registry import get_plugin
from specla.testing.drafters import OracleDrafter

import transformers_checks
from transformers_checks import check_cuda_graphs_equal_transformers, check_kernels_equal_reference, write_mtp_layer
from trees import for_kernels, needs_triton
from specla.tree import DraftTree

ARCH = get_plugin("qwen")
V = 61


def test_ngram_drafts_and_stop_tokens_equal_transformers_greedy():
    """The default drafter on repetitive prompts, with a stop token that ends sequences at
    different steps, batch of 3."""
    model = ARCH.tiny_model("base", seed=4, dtype=torch.float32)
    motif = [5, 17, 33, 8]
    prompts = [motif * 6, [9] + motif * 4, [2, 2, 2]]
    refs = [ARCH.reference_decode(model, p, 24) for p in prompts]
    stop = refs[0][10]
    want = [r[: r.index(stop) + 1] if stop in r else r for r in refs]
    out = specla.run(model, prompts=prompts, config=dict(max_new_tokens=24, stop_token_ids=[stop]))
    assert out.outputs == want


def test_a_multimodal_model_runs_unchanged():
    """The text part of a ``Qwen3_5ForConditionalGeneration`` runs as its own model: equal to
    transformers' greedy decoding."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from specla_qwen.plugin import TINY_BASE

    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    torch.manual_seed(0)
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32, patch_size=4,
                  temporal_patch_size=1, spatial_merge_size=1)
    mm = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=dict(TINY_BASE), vision_config=vision)).eval()
    assert specla.run(mm, prompts=[prompt], config=dict(max_new_tokens=10)).outputs == \
        [ARCH.reference_decode(mm, prompt, 10)]


def test_a_run_longer_than_the_cache_is_refused_and_leaves_the_state_untouched():
    """Prefill sizes each KV cache for prompt + ``max_new_tokens`` + draft depth (256 here);
    verifying past it raises a SpecError naming the cache, and the state, pending commit
    included, is left as it was: the next root logits equal a twin adapter's that never tried."""
    model = ARCH.tiny_model("base", seed=6, dtype=torch.float32)
    cfg = SpecConfig(max_new_tokens=2, num_draft_tokens=6, max_depth=6)
    ad, twin = ARCH.make_adapter(model, cfg), ARCH.make_adapter(model, cfg)
    for a in (ad, twin):
        a.prefill([list(range(1, 61)) * 4])  # 240 tokens: 239 in the cache, capacity 256
    chain = DraftTree.from_lists([([1, 2, 3, 4, 5, 6], [-1, 0, 1, 2, 3, 4])])
    # commit the whole chain, whatever the logits say
    acc = Acceptance(path=torch.arange(7)[None], num_accepted=torch.tensor([6]), bonus=torch.tensor([7]),
                     tokens=chain.tokens)
    err = None
    for _ in range(10):
        try:
            out = ad.verify(chain)
        except SpecError as e:
            err = e
            break
        ad.commit(chain, out, acc)
        twin.commit(chain, twin.verify(chain), acc)
    assert err is not None and "the KV cache holds 256 tokens and this pass needs" in str(err)
    assert ad.pending is not None
    empty = DraftTree(torch.zeros(1, 0, dtype=torch.int64), torch.zeros(1, 0, dtype=torch.int64),
                      torch.zeros(1, dtype=torch.int64))
    assert torch.equal(ad.verify(empty).logits, twin.verify(empty).logits)


def test_caches_too_large_for_memory_are_refused_before_anything_changes():
    """A ``max_new_tokens`` no memory can hold (an EOS left to end the run) sizes KV caches of
    terabytes: refused with a ConfigError naming the size before anything is allocated (on a
    CPU the process would otherwise be killed), the decoder usable afterwards with the same
    output as a decoder that never tried."""
    model = ARCH.tiny_model("base", seed=6, dtype=torch.float32)
    prompt = [5, 17, 33, 9, 44]
    dec = SpecDecoder(model, None, config=dict(max_new_tokens=4, dtype="float32"))
    first = dec.generate([prompt]).outputs
    big = SpecDecoder(model, None, config=dict(max_new_tokens=2**31 - 1, dtype="float32"))  # the most it takes
    capacity = big.adapter.capacity
    for _ in range(2):
        with pytest.raises(specla.ConfigError, match=r"the attention layers' KV caches would take [0-9.]+ GiB for "
                                                     r"max_new_tokens=2147483647 .* lower max_new_tokens"):
            big.generate([prompt])
    assert big.adapter.capacity == capacity
    assert dec.generate([prompt]).outputs == first == [ARCH.reference_decode(model, prompt, 4)]


def test_a_directory_without_config_json_is_refused_by_name(tmp_path):
    from specla.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="no config.json"):
        ARCH.load_model(tmp_path, dtype=None, device=None)


def test_threads_sharing_a_decoder_each_get_their_own_answer():
    """Four threads on one decoder, different prompts: each gets transformers' greedy output."""
    from concurrent.futures import ThreadPoolExecutor

    model = ARCH.tiny_model("base", seed=7, dtype=torch.float32)
    dec = SpecDecoder(model, config=dict(max_new_tokens=8))
    prompts = [[i + 1, 2 * i + 3, 5] for i in range(4)]
    refs = [ARCH.reference_decode(model, p, 8) for p in prompts]
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda p: dec.generate([p]).outputs[0], prompts))
    assert outs == refs


@needs_triton
@pytest.mark.parametrize("variant, graphs", [("base", "off"), ("gva", "unrecorded")])
def test_the_gdn_kernels_in_qwen_layers_equal_transformers_greedy(variant, graphs):
    """``kernels="triton"`` (interpreted on a CPU): the GDN layers verify with the gdn plugin's
    kernels, the pending commit fused into them, eagerly and in the fixed-shape step; float32,
    accepted tree drafts: outputs equal transformers' greedy decoding and the recurrent states
    equal the PyTorch path's."""
    check_kernels_equal_reference(ARCH, variant, graphs, V)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("variant", ARCH.tiny_variants)
def test_cuda_kernels_and_graphs_equal_transformers_greedy(variant):
    """On a GPU with the defaults (the gdn plugin's Triton kernels in the GDN layers, recorded
    CUDA graphs for prefill and steps), float32, accepted tree drafts, a ragged batch: every
    output equals transformers' greedy decoding of the same model on the GPU, and steps were
    recorded (MoE experts on transformers' graph-safe ``batched_mm``)."""
    check_cuda_graphs_equal_transformers(ARCH, variant, V)


def test_eager_moe_experts_refuse_a_recorded_step_by_name():
    """transformers' eager MoE experts read the experts hit on the host: a fixed-shape step is
    refused with a ConfigError naming them (``auto`` runs such a model eagerly), and the graph-safe
    ``batched_mm`` experts run the fixed-shape step token-identically."""
    model = ARCH.tiny_model("moe", seed=3, dtype=torch.float32)
    prompts = [[3, 5, 7, 9, 11], [4, 6]]
    refs = [ARCH.reference_decode(model, p, 8) for p in prompts]
    with pytest.raises(specla.ConfigError, match="MoE experts run transformers' 'eager' implementation"):
        SpecDecoder(model, drafter="ngram", config=dict(max_new_tokens=8, engine=dict(cuda_graphs="unrecorded")))
    model.config._experts_implementation = "batched_mm"
    dec = SpecDecoder(model, drafter=OracleDrafter(prompts, refs, "tree", V),
                      config=dict(max_new_tokens=8, num_draft_tokens=4, max_depth=3, top_k=2,
                                  engine=dict(cuda_graphs="unrecorded")))
    assert dec.generate(prompts).outputs == refs


def grouped_mm_runs(device: str, graphs: str) -> tuple[list, list, SpecDecoder]:
    """The tiny MoE model in bfloat16 on transformers' ``grouped_mm`` experts: plain decoding's
    outputs, then an oracle tree's (drafting those outputs) and its decoder, with ``graphs``."""
    model = ARCH.tiny_model("moe", seed=3, dtype=torch.bfloat16).to(device)
    model.config._experts_implementation = "grouped_mm"
    prompts = [[3, 5, 7, 9, 11], [4, 6]]

    def decoder(drafter, **tree):
        return SpecDecoder(model, drafter=drafter, config=dict(max_new_tokens=12, dtype="bfloat16", device=device,
                                                               engine=dict(cuda_graphs=graphs, budget_policy="fixed"),
                                                               **tree))

    plain = decoder("ngram", num_draft_tokens=0).generate(prompts).outputs
    dec = decoder(OracleDrafter(prompts, plain, "tree", V), num_draft_tokens=6, max_depth=4, top_k=2)
    return plain, dec.generate(prompts).outputs, dec


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_grouped_mm_experts_record_in_bfloat16():
    """transformers' ``grouped_mm`` experts (its default for a loaded checkpoint, and the
    experts of benchmarks/hybrid_study.py's Qwen3.5-35B-A3B shape) in bfloat16: plain and tree
    steps are recorded in CUDA graphs and decode what the same fixed-shape steps decode unrecorded."""
    plain, tree, dec = grouped_mm_runs("cuda", "on")
    assert dec.engine._runner is not None and dec.engine._runner.graphs
    assert (plain, tree) == grouped_mm_runs("cuda", "unrecorded")[:2]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_eager_moe_experts_run_eager_steps():
    """On a GPU, a MoE model on transformers' eager experts runs with ``cuda_graphs="auto"``
    (the default) through eager steps, token-identical to transformers' greedy decoding."""
    dec = transformers_checks.check_cuda_eager_steps_equal_transformers(ARCH, "moe", V, 10, prompt_seed=4)
    assert dec.engine._runner is None


@pytest.mark.parametrize("kernels", ["reference", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("variant", ["base", "next"])
def test_the_mtp_layer_drafts_what_transformers_computes_from_it(variant, kernels, tmp_path, monkeypatch):
    """``drafter="mtp"`` on a checkpoint with an MTP layer: the first draft level's top-k equals
    an independent teacher-forced pass (transformers' own decoder layer over every prompt pair
    (final-normed target feature ``f_p``, embedding of ``x_{p+1}``), causal, the model's rotary at
    position ``p``, then the MTP norm and the LM head); and decoding with it is exact. On the
    PyTorch forms and on the Triton forms (the level's attention with grouped key/value heads,
    the top-k, the tree bookkeeping and the cache update). The drafter's reset takes the prompt
    pairs in passes of 4 (three passes, the last one padded), so each pass's rotary positions
    start where the previous one ended."""
    from transformers import AutoModelForCausalLM

    import specla.drafters.eagle as eagle_module
    from specla.drafters.mtp import MTPDrafter

    monkeypatch.setattr(eagle_module, "PAIR_PASS", 4)
    monkeypatch.setattr(eagle_module, "PAIR_ROUND", 2)
    from specla.testing.transformers_oracle import torch_path

    ARCH.tiny_model(variant, seed=3, dtype=torch.float32).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    if variant == "next":
        model.config._experts_implementation = "eager"
    written = write_mtp_layer(tmp_path, model)
    prompt = [5, 17, 33, 8, 5, 17, 33, 8, 2, 9, 40]
    refs = [ARCH.reference_decode(model, p, 12) for p in (prompt, prompt[:4])]
    target = for_kernels(model, kernels)  # the oracle below stays on the CPU
    # eager steps, and the fixed-shape step a CUDA graph records (not with the eager MoE experts the
    # "next" variant is loaded with here, which that step refuses by name)
    for graphs in ("off", "unrecorded") if variant == "base" else ("off",):
        dec = SpecDecoder(target, drafter="mtp", config=dict(max_new_tokens=12, num_draft_tokens=6, max_depth=3,
                                                            top_k=3, engine=dict(kernels=kernels, cuda_graphs=graphs)))
        assert isinstance(dec.drafter, MTPDrafter) and dec.drafter.kernels == (kernels == "triton")
        out = dec.generate([prompt, prompt[:4]])
        assert out.outputs == refs, graphs
        if variant == "base":  # its random layer's drafts are accepted here (the "next" one's are not)
            assert sum(out.stats.accepted_histogram[1:]) > 0, "no draft was accepted: the drafts were not checked"

    from specla.ops.topk import log_softmax_topk

    dr, ad = dec.drafter, dec.adapter
    ad.prefill([prompt])
    dr.reset([prompt])
    with torch.no_grad():
        _, logits = dr._expand(dr._root_state(), None, dr.root[:, None])
        top_logp, top_tok = log_softmax_topk(logits, 3)
        # the oracle: the layer as written, not as specla loaded it, on the CPU model (the decoder's
        # copy may be on the GPU)
        from specla_qwen.spec import text_parts

        text, head = text_parts(model)[0], written
        ids = torch.tensor([prompt])
        with torch_path(model):  # transformers' PyTorch path on a CPU
            f = model.model(ids[:, :-1]).last_hidden_state  # final-normed features f_0 .. f_{L-2}
        e = text.embed_tokens(ids[:, 1:])
        h = head.fc(torch.cat([head.pre_fc_norm_embedding(e), head.pre_fc_norm_hidden(f)], -1))
        pos = torch.arange(h.shape[1])[None]
        rope_pos = pos[None].expand(3, -1, -1) if variant == "base" else pos
        y = head.layers[0](h, position_embeddings=text.rotary_emb(h, rope_pos), attention_mask=None)
        y = y[0] if isinstance(y, tuple) else y
        want = torch.log_softmax(model.lm_head(head.norm(y))[0, -1].float(), -1).topk(3)
    assert top_tok[0, 0].tolist() == want.indices.tolist()
    torch.testing.assert_close(top_logp[0, 0].cpu(), want.values, rtol=1e-4, atol=1e-5)


def test_mtp_without_an_mtp_layer_is_refused_by_name(tmp_path):
    from specla.errors import DrafterError

    model = ARCH.tiny_model("base", seed=1, dtype=torch.float32)
    with pytest.raises(DrafterError, match="names none"):
        SpecDecoder(model, drafter="mtp")
    model.save_pretrained(tmp_path)
    with pytest.raises(DrafterError, match="holds none"):
        SpecDecoder(str(tmp_path), drafter="mtp")


def test_grouped_query_draft_attention_equals_repeated_heads():
    """The drafter's attention with fewer key/value heads than query heads (the MTP layer's) equals
    the same attention with each key/value head repeated for its query group."""
    from specla.ops.attention import draft_attention

    g = torch.Generator().manual_seed(4)
    B, M, A, H, HKV, L, Dh = 2, 3, 2, 6, 2, 9, 8
    q = torch.randn(B, M, H, Dh, generator=g, dtype=torch.float64)
    ck, cv = (torch.randn(B, L, HKV, Dh, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(B, M, A, HKV, Dh, generator=g, dtype=torch.float64) for _ in range(2))
    n = torch.tensor([0, 7])
    rep = lambda x, d: x.repeat_interleave(H // HKV, d)  # noqa: E731
    want = draft_attention(q, rep(ck, 2), rep(cv, 2), n, rep(k, 3), rep(v, 3))
    torch.testing.assert_close(draft_attention(q, ck, cv, n, k, v), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("variant", ["moe", "next"])
def test_a_moe_checkpoint_runs_in_float64_and_the_callers_model_is_left_as_it_was(variant, tmp_path):
    """A saved MoE checkpoint loaded by path (transformers' grouped-GEMM experts by default, which
    take no float64) runs with ``dtype="float64"``; a model in training mode is used through an
    eval-mode copy and stays in training mode; both equal transformers' greedy decoding."""
    model = ARCH.tiny_model(variant, seed=2, dtype=torch.float32)
    model.save_pretrained(tmp_path)
    prompt = [4, 8, 15, 16, 23, 42]
    want = ARCH.reference_decode(model.double(), prompt, 8)
    dec = SpecDecoder(str(tmp_path), config=dict(max_new_tokens=8, dtype="float64"))
    assert dec.generate([prompt]).outputs == [want]
    model.train()
    assert SpecDecoder(model, config=dict(max_new_tokens=8)).generate([prompt]).outputs == [want]
    assert model.training


def test_torch_path_runs_a_cached_generate_on_the_cpu():
    """``torch_path`` covers the decode steps of transformers' own cached ``generate`` too: the
    recurrent gated delta rule, which transformers otherwise sends to FLA's Triton kernel (on a
    CPU without the interpreter: "0 active drivers"), is transformers' PyTorch function in the
    block, and the greedy tokens equal the no-cache oracle's and specla's."""
    import sys

    from specla.testing.transformers_oracle import torch_path, transformers_greedy

    model = ARCH.tiny_model("base", seed=4, dtype=torch.float32)
    module = sys.modules[type(model).__module__]
    hub = module.torch_recurrent_gated_delta_rule
    prompt = [5, 17, 33, 8, 2, 9]
    x = torch.tensor([prompt])
    with torch_path(model), torch.no_grad():
        assert module.torch_recurrent_gated_delta_rule is getattr(hub, "__wrapped__", hub)
        ids = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=10, do_sample=False, pad_token_id=0)
    cached = ids[0, len(prompt):].tolist()
    assert cached == transformers_greedy(model, prompt, 10)
    assert cached == specla.run(model, prompts=[prompt], config=dict(max_new_tokens=10)).outputs[0]


@pytest.mark.skipif(not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") != "1",
                    reason="FLA's and the gdn plugin's Triton kernels need a GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("variant", ["base", "next"])
def test_whole_prompt_prefill_equals_transformers_greedy(variant, monkeypatch):
    """``prefill="chunked"``: every prompt of a ragged batch in one pass (the GDN layers through
    FLA's chunked kernel, the attention layers causal over the prompt and written to the cache at
    once), then decoding with accepted tree drafts: outputs equal transformers' greedy decoding."""
    transformers_checks.check_whole_prompt_prefill_equals_transformers(ARCH, variant, V, monkeypatch)


def test_the_demo_target_is_the_fla_target_in_qwen3_5_form(tmp_path):
    """The qwen plugin's demo target is what benchmarks/targets/gdn_to_qwen3_5.py makes of the
    trained FLA target (the same files, byte for byte), transformers' Qwen3_5ForCausalLM on its
    PyTorch path gives FLA's own logits (FLA's kernels interpreted; float32, within 1e-4 of
    logits up to ~16), and specla decodes the two the same, token for token."""
    import importlib.util
    import json
    from pathlib import Path

    from fla_oracle import enable_fla_interpreter, fla_forward_logits
    from safetensors.torch import load_file
    from specla.testing.transformers_oracle import torch_path
    from specla_fla.plugin import TINY_TARGET

    enable_fla_interpreter()
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "targets" / "gdn_to_qwen3_5.py"
    spec = importlib.util.spec_from_file_location("gdn_to_qwen3_5", script)
    convert = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(convert)
    convert.convert(TINY_TARGET, tmp_path)
    shipped = ARCH.demo_checkpoint
    assert json.loads((tmp_path / "config.json").read_text()) == json.loads((shipped / "config.json").read_text())
    ours, theirs = load_file(str(tmp_path / "model.safetensors")), load_file(str(shipped / "model.safetensors"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)

    from fla.models import GatedDeltaNetForCausalLM

    fla = GatedDeltaNetForCausalLM.from_pretrained(str(TINY_TARGET), dtype=torch.float32).eval()
    qwen = ARCH.load_model(shipped, dtype=torch.float32, device="cpu").eval()
    ids = torch.randint(3, fla.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), torch_path(qwen):
        got = qwen(ids, use_cache=False).logits
    want = fla_forward_logits(fla, ids)
    assert (got - want).abs().max().item() < 1e-4
    cfg = dict(max_new_tokens=24, dtype="float32", stop_at_eos=False)
    prompt = [[1, 450, 6635, 3290, 2901]]
    assert specla.run(shipped, prompts=prompt, config=cfg).outputs == specla.run(TINY_TARGET, prompts=prompt,
                                                                                 config=cfg).outputs
