"""Checks shared by the tests of the plugins for transformers' hybrid classes (qwen,
mamba2_hybrid): each runs a plugin's tiny model against transformers' own greedy decoding."""

import torch

from specla import SpecDecoder
from specla.testing.drafters import OracleDrafter


def prompts_around_the_prefill_chunk(seed: int, vocab: int, lengths=(1, 63, 64, 65, 129)) -> list[list[int]]:
    """Random prompts of the given lengths (around the 64-token prefill chunk)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def check_kernels_equal_reference(arch, variant: str, graphs: str, vocab: int, verify_kernel: str = "auto") -> None:
    """``kernels="triton"`` against ``"reference"`` on the plugin's tiny ``variant`` (float32,
    accepted tree drafts, ``cuda_graphs=graphs``, ``verify_kernel``): both outputs equal
    transformers' greedy decoding, the kernels ran only where asked, and the recurrent states agree
    (rtol 1e-4, atol 1e-5)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = arch.tiny_model(variant, seed=9, dtype=torch.float32).to(dev)
    prompts = [[3], [7, 1, 9, 4, 4], [i % (vocab - 1) + 1 for i in range(12)]]
    refs = [arch.reference_decode(model, p, 10) for p in prompts]
    states = {}
    for kernels in ("triton", "reference"):
        dec = SpecDecoder(model, drafter=OracleDrafter(prompts, refs, "tree", vocab),
                          config=dict(max_new_tokens=10, num_draft_tokens=6, max_depth=4, top_k=2,
                                      engine=dict(kernels=kernels, cuda_graphs=graphs, verify_kernel=verify_kernel)))
        out = dec.generate(prompts)
        assert out.outputs == refs and out.stats.mean_accepted_tokens > 1
        assert dec.adapter._use_kernel("factor") == (kernels == "triton")
        states[kernels] = dec.adapter.recurrent_states()
    for a, b in zip(states["triton"], states["reference"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def check_cuda_graphs_equal_transformers(arch, variant: str, vocab: int, new_tokens: int = 18,
                                        kernels: bool = True) -> None:
    """On a GPU with the defaults (recorded CUDA graphs for the steps, the plugin's Triton kernels
    where ``kernels`` says it has them, MoE experts on transformers' graph-safe ``batched_mm``),
    float32, accepted tree drafts, a ragged batch: every output equals transformers' greedy
    decoding, and the steps were recorded."""
    model = arch.tiny_model(variant, seed=2, dtype=torch.float32).cuda()
    model.config._experts_implementation = "batched_mm"
    prompts = prompts_around_the_prefill_chunk(8, vocab)
    refs = [arch.reference_decode(model, p, new_tokens) for p in prompts]
    dec = SpecDecoder(model, drafter=OracleDrafter(prompts, refs, "tree", vocab),
                      # fixed: every step drafts, and the accepted drafts are asserted
                      config=dict(max_new_tokens=new_tokens, num_draft_tokens=6, max_depth=4, top_k=2,
                                  engine=dict(cuda_graphs="on", budget_policy="fixed")))
    out = dec.generate(prompts)
    assert out.outputs == refs and out.stats.mean_accepted_tokens > 1
    assert dec.engine._runner is not None and dec.engine._runner.graphs
    assert not kernels or dec.adapter._use_kernel("factor")


def check_cuda_eager_steps_equal_transformers(arch, variant: str, vocab: int, new_tokens: int,
                                              prompt_seed: int = 8) -> SpecDecoder:
    """On a GPU with the defaults where the steps run eagerly (a plugin without the CUDA-graph
    capability, or a module a graph cannot record), float32, accepted tree drafts, a ragged batch
    around the prefill chunk: every output equals transformers' greedy decoding of the same model
    on the GPU. Returns the decoder."""
    model = arch.tiny_model(variant, seed=2, dtype=torch.float32).cuda()
    prompts = prompts_around_the_prefill_chunk(prompt_seed, vocab)
    refs = [arch.reference_decode(model, p, new_tokens) for p in prompts]
    dec = SpecDecoder(model, drafter=OracleDrafter(prompts, refs, "tree", vocab),
                      config=dict(max_new_tokens=new_tokens, num_draft_tokens=6, max_depth=4, top_k=2))
    assert dec.generate(prompts).outputs == refs
    return dec


def check_whole_prompt_prefill_equals_transformers(arch, variant: str, vocab: int | None, monkeypatch,
                                                    fla: bool = True) -> None:
    """``prefill="chunked"``, ``kernels="triton"`` (FLA's kernels interpreted on a CPU): every
    prompt of a ragged batch (lengths 1, 66, 9: both sides of the 64-token chunks) in one pass,
    then decoding with accepted tree drafts: outputs equal transformers' greedy decoding, and the
    whole-prompt pass ran, through FLA's chunked kernels where ``fla`` (``vocab``: the model's own
    when ``None``). On a GPU, where FLA's chunked kernels multiply float32 in TF32 and near-ties
    may differ from transformers', outputs equal plain decoding's with the same prefill and the
    recurrent states after the prefill equal the 64-token chain passes' within TF32 tolerance
    (on a CPU the GDN kernel tests compare those states at 1e-4)."""
    from fla_oracle import whole_prompt_prefill_calls

    calls = whole_prompt_prefill_calls(monkeypatch)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = arch.tiny_model(variant, seed=4, dtype=torch.float32)
    vocab = vocab or model.config.vocab_size
    prompts = prompts_around_the_prefill_chunk(5, vocab, lengths=(1, 66, 9))
    refs = [arch.reference_decode(model, p, 8) for p in prompts]  # on the CPU: the references' torch path
    model.to(dev)
    dec = SpecDecoder(model, drafter=OracleDrafter(prompts, refs, "tree", vocab),
                      config=dict(max_new_tokens=8, num_draft_tokens=6, max_depth=4, top_k=2,
                                  engine=dict(kernels="triton", cuda_graphs="off", prefill="chunked")))
    out = dec.generate(prompts)
    assert dec.adapter._prefill_mode(len(prompts)) == "whole" and bool(calls) == fla
    assert out.stats.mean_accepted_tokens > 1
    if dev == "cpu":
        assert out.outputs == refs
        return
    plain = SpecDecoder(model, config=dict(max_new_tokens=8, num_draft_tokens=0, engine=dict(prefill="chunked")))
    assert out.outputs == plain.generate(prompts).outputs
    states = []
    for prefill in ("chunked", "chain"):
        ad = SpecDecoder(model, config=dict(engine=dict(kernels="triton", cuda_graphs="off", prefill=prefill))).adapter
        ad.prefill(prompts)
        states.append(ad.recurrent_states())
    for a, b in zip(*states):  # TF32: FLA's GLA hybrid with attention differed by 2.4e-3 on an H200
        torch.testing.assert_close(a, b, rtol=1e-2, atol=5e-3)


def write_mtp_layer(directory, model, seed=0):
    """A random MTP layer for ``model`` as ``directory/mtp.safetensors`` (``mtp.*`` names, MoE
    experts one tensor per expert and projection, as the checkpoints ship it in their shards),
    built from the model's own classes. Returns the layer (the oracle's copy)."""
    from safetensors.torch import save_file

    from specla_qwen.spec import text_parts

    torch.manual_seed(seed)
    text, _ = text_parts(model)
    cfg = text.config
    li = list(cfg.layer_types).index("full_attention")
    H = cfg.hidden_size
    head = torch.nn.Module()
    head.fc = torch.nn.Linear(2 * H, H, bias=False)
    head.pre_fc_norm_embedding, head.pre_fc_norm_hidden, head.norm = (type(text.norm)(H) for _ in range(3))
    head.layers = torch.nn.ModuleList([type(text.layers[li])(cfg, li)])
    with torch.no_grad():  # every weight drawn here: a layer built outside from_pretrained leaves its experts empty
        for name, p in head.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
            else:
                p.copy_(torch.randn_like(p) * 0.1)
    tensors = {}
    for k, v in head.state_dict().items():
        if k.endswith("experts.gate_up_proj"):  # [E, 2 I, H]: each expert's gate rows, then its up rows
            stem = k.rsplit(".", 1)[0]
            for e, w in enumerate(v):
                gate, up = w.chunk(2, 0)
                tensors.update({f"mtp.{stem}.{e}.gate_proj.weight": gate, f"mtp.{stem}.{e}.up_proj.weight": up})
        elif k.endswith("experts.down_proj"):
            tensors.update({f"mtp.{k.rsplit('.', 1)[0]}.{e}.down_proj.weight": w for e, w in enumerate(v)})
        else:
            tensors[f"mtp.{k}"] = v
    save_file({k: v.detach().to(text.norm.weight.dtype).contiguous() for k, v in tensors.items()},
              str(directory / "mtp.safetensors"))
    return head.to(text.norm.weight.dtype).eval()
