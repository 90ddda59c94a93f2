"""The mamba2_hybrid plugin against transformers' own Mamba2-family classes (Mamba2, Bamba, Granite
4.0-H, Nemotron-H, Falcon-H1): token identity with their greedy decoding (no-cache forwards on the
PyTorch path), the ``mamba2`` model type shared with FLA's class,
the Triton kernels and CUDA graphs."""

import os

import pytest
import torch

import specla
from specla import SpecDecoder
from specla.errors import UnsupportedModelError
from specla.registry import detect_plugin, get_plugin
from specla.testing.drafters import OracleDrafter

import transformers_checks
from transformers_checks import check_cuda_graphs_equal_transformers, check_kernels_equal_reference
from trees import for_kernels, needs_triton

ARCH = get_plugin("mamba2_hybrid")
V = 41


def test_ngram_drafts_and_stop_tokens_equal_transformers_greedy():
    """The default drafter on repetitive prompts with a stop token that ends sequences at
    different steps (Falcon-H1: two mixers in every layer)."""
    model = ARCH.tiny_model("falcon_h1", seed=4, dtype=torch.float32)
    motif = [5, 17, 33, 8]
    prompts = [motif * 6, [9] + motif * 4, [2, 2, 2]]
    refs = [ARCH.reference_decode(model, p, 20) for p in prompts]
    stop = refs[0][8]
    want = [r[: r.index(stop) + 1] if stop in r else r for r in refs]
    out = specla.run(model, prompts=prompts, config=dict(max_new_tokens=20, stop_token_ids=[stop]))
    assert out.outputs == want


def test_the_mamba2_model_type_goes_to_the_plugin_of_its_class(tmp_path):
    """FLA's and transformers' ``Mamba2ForCausalLM`` both say ``model_type="mamba2"``: a loaded
    model and a saved checkpoint directory of each are detected as their own plugin's and decode
    like their own greedy decoding; each plugin refuses the other's model by name."""
    hf = ARCH.tiny_model("mamba2", seed=5, dtype=torch.float32)
    fla_arch = get_plugin("mamba2")
    fla = fla_arch.tiny_model("base", seed=5, dtype=torch.float32)
    hf.save_pretrained(tmp_path / "hf")
    fla.save_pretrained(tmp_path / "fla")
    assert detect_plugin(hf) is ARCH and detect_plugin(str(tmp_path / "hf")) is ARCH
    assert detect_plugin(fla) is fla_arch and detect_plugin(str(tmp_path / "fla")) is fla_arch
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    assert specla.run(str(tmp_path / "hf"), prompts=[prompt], config=dict(max_new_tokens=8)).outputs == \
        [ARCH.reference_decode(hf, prompt, 8)]
    assert specla.run(str(tmp_path / "fla"), prompts=[prompt], config=dict(max_new_tokens=8)).outputs == \
        [fla_arch.reference_decode(fla, prompt, 8)]
    with pytest.raises(UnsupportedModelError, match="transformers' Mamba2ForCausalLM runs on the mamba2_hybrid plugin"):
        fla_arch.check_model(hf)
    with pytest.raises(UnsupportedModelError, match="the mamba2_hybrid plugin runs transformers' Mamba2ForCausalLM"):
        ARCH.check_model(fla)
    with pytest.raises(UnsupportedModelError, match="an FLA Mamba2 checkpoint"):
        ARCH.load_model(tmp_path / "fla", dtype=None, device=None)


def test_eager_moe_experts_refuse_a_recorded_step_by_name():
    """transformers' eager MoE experts read the experts hit on the host: a fixed-shape step is
    refused with a ConfigError naming them; ``batched_mm`` experts run it token-identically."""
    model = ARCH.tiny_model("nemotron_h", seed=3, dtype=torch.float32)
    prompts = [[3, 5, 7, 9, 11], [4, 6]]
    refs = [ARCH.reference_decode(model, p, 8) for p in prompts]
    with pytest.raises(specla.ConfigError, match="MoE experts run transformers' 'eager' implementation"):
        SpecDecoder(model, drafter="ngram", config=dict(max_new_tokens=8, engine=dict(cuda_graphs="unrecorded")))
    model.config._experts_implementation = "batched_mm"
    dec = SpecDecoder(model, drafter=OracleDrafter(prompts, refs, "tree", V),
                      config=dict(max_new_tokens=8, num_draft_tokens=4, max_depth=3, top_k=2,
                                  engine=dict(cuda_graphs="unrecorded")))
    assert dec.generate(prompts).outputs == refs


@needs_triton
@pytest.mark.parametrize("variant, graphs", [("falcon_h1", "off"), ("bamba", "unrecorded")])
def test_the_mamba2_kernels_in_hybrid_layers_equal_transformers_greedy(variant, graphs):
    """``kernels="triton"`` (interpreted on a CPU): the Mamba2 layers verify with the mamba2
    plugin's kernels, the pending commit fused into them, eagerly and in the fixed-shape step;
    float32, accepted tree drafts: outputs equal transformers' greedy decoding and the recurrent
    states equal the PyTorch path's."""
    check_kernels_equal_reference(ARCH, variant, graphs, V)


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="FLA's and the mamba2 plugin's Triton kernels need a GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("variant", ARCH.tiny_variants)
def test_whole_prompt_prefill_equals_transformers_greedy(variant, monkeypatch):
    """``prefill="chunked"``: the Mamba2 layers through FLA's chunked simple GLA (SSD's scalar
    decay per head), attention layers causal over the prompt, in one pass for a ragged batch,
    then tree drafts: outputs equal transformers' greedy decoding, for every family."""
    transformers_checks.check_whole_prompt_prefill_equals_transformers(ARCH, variant, V, monkeypatch)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("variant", ARCH.tiny_variants)
def test_cuda_kernels_and_graphs_equal_transformers_greedy(variant):
    """On a GPU with the defaults (the mamba2 plugin's Triton kernels, recorded CUDA graphs for
    prefill and steps; MoE experts on transformers' graph-safe ``batched_mm``), float32,
    accepted tree drafts, a ragged batch: every output equals transformers' greedy decoding of the
    same model on the GPU, and steps were recorded."""
    check_cuda_graphs_equal_transformers(ARCH, variant, V)


def write_nemotron_mtp(directory, model, seed=0):
    """A random Nemotron-H MTP module for ``model`` (attention then MoE, the default
    ``mtp_layers_block_type``) as ``directory/mtp.safetensors`` under the names the checkpoints
    ship (``mtp.layers.{i}.*``, MoE experts one tensor per expert), built from transformers' own
    classes. Returns the blocks (the oracle's copy)."""
    import copy

    from safetensors.torch import save_file
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHBlock, NemotronHRMSNorm

    torch.manual_seed(seed)
    cfg = copy.copy(model.config)
    cfg.layers_block_type = list(cfg.mtp_layers_block_type)
    H = cfg.hidden_size
    blocks = torch.nn.ModuleList([NemotronHBlock(cfg, i) for i in range(len(cfg.layers_block_type))])
    blocks[0].enorm, blocks[0].hnorm = NemotronHRMSNorm(H), NemotronHRMSNorm(H)
    blocks[0].eh_proj = torch.nn.Linear(2 * H, H, bias=False)
    blocks[-1].final_layernorm = NemotronHRMSNorm(H)
    tensors = {}
    with torch.no_grad():  # every weight drawn here: a block built outside from_pretrained leaves its experts empty
        for name, p in [*blocks.named_parameters(), *blocks.named_buffers()]:
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
            if name.endswith(("experts.up_proj", "experts.down_proj")):
                stem, kind = name.rsplit(".", 1)
                tensors.update({f"mtp.layers.{stem}.{e}.{kind}.weight": w.clone() for e, w in enumerate(p)})
            else:
                tensors[f"mtp.layers.{name}"] = p.detach().clone()
    save_file({k: v.to(model.dtype).contiguous() for k, v in tensors.items()}, str(directory / "mtp.safetensors"))
    return blocks.to(model.dtype).eval()


@pytest.mark.parametrize("kernels", ["reference", pytest.param("triton", marks=needs_triton)])
def test_the_nemotron_h_mtp_module_drafts_what_transformers_computes_from_it(kernels, tmp_path):
    """``drafter="mtp"`` on a Nemotron-H checkpoint with an MTP module (per-expert tensors, as
    shipped): the first draft level's top-k equals an independent teacher-forced pass
    (transformers' own ``NemotronHBlock``s over every prompt pair (final-normed target feature
    ``f_p``, embedding of ``x_{p+1}``) with causal attention, the final norm, the target's LM
    head); and decoding with it, chains and trees, is exact; on the PyTorch forms and on the
    Triton forms of the level's attention, top-k, tree bookkeeping and cache update."""
    from transformers import NemotronHForCausalLM

    from specla.drafters.mtp import MTPDrafter
    from specla.testing.transformers_oracle import torch_path

    tiny = ARCH.tiny_model("nemotron_h", seed=3, dtype=torch.float32)
    tiny.config.num_nextn_predict_layers = 1
    tiny.save_pretrained(tmp_path)
    model = NemotronHForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    model.config._experts_implementation = "eager"
    blocks = write_nemotron_mtp(tmp_path, model)
    prompt = [5, 17, 33, 8, 5, 17, 33, 8, 2, 9, 40]
    refs = [ARCH.reference_decode(model, p, 12) for p in (prompt, prompt[:4])]
    target = for_kernels(model, kernels)  # the oracle below stays on the CPU
    for budget in (dict(num_draft_tokens=3, max_depth=3, top_k=1), dict(num_draft_tokens=6, max_depth=3, top_k=3)):
        dec = SpecDecoder(target, drafter="mtp", config=dict(max_new_tokens=12, engine=dict(kernels=kernels), **budget))
        assert isinstance(dec.drafter, MTPDrafter) and dec.drafter.kernels == (kernels == "triton")
        assert dec.generate([prompt, prompt[:4]]).outputs == refs

    from specla.ops.topk import log_softmax_topk

    dr, ad = dec.drafter, dec.adapter
    ad.prefill([prompt])
    dr.reset([prompt])
    with torch.no_grad():
        _, logits = dr._expand(dr._root_state(), None, dr.root[:, None])
        top_logp, top_tok = log_softmax_topk(logits, 3)
        ids = torch.tensor([prompt])
        with torch_path(model):  # transformers' PyTorch path on a CPU
            f = model.model(ids[:, :-1]).last_hidden_state  # final-normed features f_0 .. f_{L-2}
        e = model.model.embeddings(ids[:, 1:])
        h = blocks[0].eh_proj(torch.cat([blocks[0].enorm(e), blocks[0].hnorm(f)], -1))
        for block in blocks:
            h = block(h)
        want = torch.log_softmax(model.lm_head(blocks[-1].final_layernorm(h))[0, -1].float(), -1).topk(3)
    assert top_tok[0, 0].tolist() == want.indices.tolist()
    torch.testing.assert_close(top_logp[0, 0].cpu(), want.values, rtol=1e-4, atol=1e-5)


def test_mtp_is_refused_by_name_without_a_fitting_module(tmp_path):
    """``drafter="mtp"``: a family whose checkpoints ship no MTP module, a checkpoint without
    ``mtp.*`` tensors, tensors with an expert missing or of another shape, and a plugin without
    model drafters are each refused with a DrafterError naming the problem."""
    from safetensors.torch import load_file, save_file

    from specla.errors import DrafterError

    with pytest.raises(DrafterError, match="only Nemotron-H"):
        SpecDecoder(ARCH.tiny_model("bamba", seed=1, dtype=torch.float32), drafter="mtp")
    ARCH.tiny_model("nemotron_h", seed=1, dtype=torch.float32).save_pretrained(tmp_path)
    from transformers import NemotronHForCausalLM

    model = NemotronHForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    with pytest.raises(DrafterError, match="holds none"):
        SpecDecoder(model, drafter="mtp")
    write_nemotron_mtp(tmp_path, model)
    tensors = load_file(str(tmp_path / "mtp.safetensors"))
    del tensors["mtp.layers.1.mixer.experts.2.up_proj.weight"]
    save_file(tensors, str(tmp_path / "mtp.safetensors"))
    with pytest.raises(DrafterError, match="not numbered"):
        SpecDecoder(model, drafter="mtp")
    tensors["mtp.layers.1.mixer.experts.2.up_proj.weight"] = tensors["mtp.layers.1.mixer.experts.1.up_proj.weight"][:-1].clone()
    save_file(tensors, str(tmp_path / "mtp.safetensors"))
    with pytest.raises(DrafterError, match="differ in shape"):
        SpecDecoder(model, drafter="mtp")
    with pytest.raises(DrafterError, match="the gdn plugin's models bring none"):
        SpecDecoder(get_plugin("gdn").tiny_model("base"), drafter="mtp")


@pytest.mark.parametrize("variant", ["bamba", "falcon_h1"])
def test_the_embedding_table_is_offered_only_where_embed_returns_its_rows(variant):
    """A drafter gathers embeddings inside its own kernel from ``embedding_table()``: Bamba's
    ``embed`` returns the table's rows, Falcon-H1's multiplies them (``embedding_multiplier``
    2), so it offers no table and the drafter calls ``embed``."""
    dec = SpecDecoder(ARCH.tiny_model(variant, seed=2, dtype=torch.float32), drafter="ngram")
    ad = dec.adapter
    tokens = torch.tensor([[3, 7], [40, 0]])
    table = ad.embedding_table()
    if variant == "falcon_h1":
        assert table is None and ad.embed_scale == 2.0
        assert torch.equal(ad.embed(tokens), ad.embed_weight[tokens] * 2.0)
    else:
        assert table is ad.embed_weight and torch.equal(ad.embed(tokens), table[tokens])
