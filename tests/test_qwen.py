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
from specla.tree import DraftTree

ARCH = get_plugin("qwen")
V = 61


def prompts_around_the_prefill_chunk(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (n,), generator=g).tolist() for n in (1, 63, 64, 65, 129)]


@pytest.mark.parametrize("variant", ARCH.tiny_variants)
@pytest.mark.parametrize("commit", ["factor", "snapshot", "replay"])
def test_tree_drafts_in_float32_equal_transformers_greedy(variant, commit):
    """A ragged batch of prompts around the 64-token prefill chunk, float32, accepted tree drafts
    (an oracle drafter; ``plugin=None`` detects the plugin from ``model_type``): every output
    equals transformers' own greedy decoding, and drafts were accepted."""
    model = ARCH.tiny_model(variant, seed=2, dtype=torch.float32)
    prompts = prompts_around_the_prefill_chunk(3)
    refs = [ARCH.reference_decode(model, p, 18) for p in prompts]
    cfg = SpecConfig(max_new_tokens=18, num_draft_tokens=6, max_depth=4, top_k=2, commit=commit)
    out = specla.run(model, prompts=prompts, drafter=OracleDrafter(prompts, refs, "tree", V), config=cfg)
    assert out.outputs == refs
    assert out.stats.mean_accepted_tokens > 1


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


def test_a_checkpoint_directory_and_a_multimodal_model_run_unchanged(tmp_path):
    """``save_pretrained`` of a tiny ``Qwen3_5ForCausalLM`` loads by path; the text part of a
    ``Qwen3_5ForConditionalGeneration`` runs as its own model: both equal transformers' greedy."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from specla_qwen.plugin import TINY_BASE

    model = ARCH.tiny_model("base", seed=5, dtype=torch.float32)
    model.save_pretrained(tmp_path / "ckpt")
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    assert specla.run(str(tmp_path / "ckpt"), prompts=[prompt], config=dict(max_new_tokens=10)).outputs == \
        [ARCH.reference_decode(model, prompt, 10)]
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


def test_bad_checkpoints_and_models_are_refused_by_name(tmp_path):
    from specla.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="no config.json"):
        ARCH.load_model(tmp_path, dtype=None, device=None)
    with pytest.raises(UnsupportedModelError, match="the qwen plugin runs Qwen3_5ForCausalLM"):
        ARCH.check_model(get_plugin("gdn").tiny_model("base"))


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


@pytest.mark.skipif(not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") != "1",
                    reason="Triton kernels need a GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("variant, graphs", [("base", "off"), ("gva", "unrecorded")])
def test_the_gdn_kernels_in_qwen_layers_equal_transformers_greedy(variant, graphs):
    """``kernels="triton"`` (interpreted on a CPU): the GDN layers verify with the gdn plugin's
    kernels, the pending commit fused into them, eagerly and in the fixed-shape step; float32,
    accepted tree drafts: outputs equal transformers' greedy decoding and the recurrent states
    equal the PyTorch path's."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = ARCH.tiny_model(variant, seed=9, dtype=torch.float32).to(dev)
    prompts = [[3], [7, 1, 9, 4, 4], [i % 60 + 1 for i in range(12)]]
    refs = [ARCH.reference_decode(model, p, 10) for p in prompts]
    states = {}
    for kernels in ("triton", "reference"):
        dec = SpecDecoder(model, drafter=OracleDrafter(prompts, refs, "tree", V),
                          config=dict(max_new_tokens=10, num_draft_tokens=6, max_depth=4, top_k=2, kernels=kernels,
                                      cuda_graphs=graphs))
        out = dec.generate(prompts)
        assert out.outputs == refs and out.stats.mean_accepted_tokens > 1
        assert dec.adapter._use_kernel("factor") == (kernels == "triton")
        states[kernels] = dec.adapter.recurrent_states()
    for a, b in zip(states["triton"], states["reference"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("variant", ARCH.tiny_variants)
def test_cuda_kernels_and_graphs_equal_transformers_greedy(variant):
    """On a GPU with the defaults (the gdn plugin's Triton kernels in the GDN layers, recorded
    CUDA graphs for prefill and steps), float32, accepted tree drafts, a ragged batch: every
    output equals transformers' greedy decoding of the same model on the GPU, and steps were
    recorded."""
    model = ARCH.tiny_model(variant, seed=2, dtype=torch.float32).cuda()
    prompts = prompts_around_the_prefill_chunk(8)
    refs = [ARCH.reference_decode(model, p, 18) for p in prompts]
    dec = SpecDecoder(model, drafter=OracleDrafter(prompts, refs, "tree", V),
                      config=dict(max_new_tokens=18, num_draft_tokens=6, max_depth=4, top_k=2, cuda_graphs="on"))
    out = dec.generate(prompts)
    assert out.outputs == refs and out.stats.mean_accepted_tokens > 1
    assert dec.engine._runner is not None and dec.engine._runner.graphs
    assert dec.adapter._use_kernel("factor")
