"""specla against FLA's own models (``GatedDeltaNetForCausalLM``, ``GLAForCausalLM``,
``Mamba2ForCausalLM``): an oracle nobody on this project wrote. On a CPU FLA's Triton kernels run
under Triton's interpreter, on a CUDA machine compiled (``tests/conftest.py`` decides, the model
and specla then run on the GPU): the same tests. FLA has no float64 kernels, so these compare
float32 runs at float32 tolerance.

FLA's greedy decoding is its forward re-run over the whole sequence for each new token
(:func:`fla_oracle.fla_greedy_generate`): its cached ``generate`` ignores the cache under
transformers 5.24 (docs/usage.md)."""

import pytest
import torch

import specla
from specla import DraftTree, SpecConfig
from specla.registry import get_plugin
from specla.testing.drafters import OracleDrafter

from fla_oracle import fla_device, fla_forward_logits, fla_greedy_generate

PLUGINS = ("gdn", "gla", "mamba2")
# max |specla - FLA| over all logits of a test, float32, several layers, different summation
# orders. Observed over every recurrent variant of the three classes, seeds 1-3: up to 4.9e-6 on
# the CPU (interpreted) and 6.0e-6 on an H100 (compiled) against FLA's recurrent kernels and
# Mamba2's PyTorch path; against FLA's chunked kernels compiled on the H100 (GDN with grad, GLA
# above 64 tokens) up to 8.4e-3, the precision of their matrix products (specla's logits are the
# same in both comparisons).
ATOL = 6e-5
CUDA_CHUNKED_ATOL = 8e-2


def fla_model(plugin: str, variant: str, seed: int) -> torch.nn.Module:
    """The plugin's tiny random float32 model on :func:`fla_device`.

    Mamba2 with ``1 < n_groups < num_heads`` is built with one group: FLA's whole-sequence path
    (``Mamba2.torch_forward``, the only one without mamba_ssm) tiles B/C over the heads (head ``h``
    reads group ``h % G``) while its decode step, its CUDA kernels and specla read group
    ``h // (H // G)`` (tests/test_mamba2.py checks a grouped layer step against FLA's)."""
    device, arch = fla_device(), get_plugin(plugin)
    model = arch.tiny_model(variant, seed=seed, dtype=torch.float32)
    if plugin == "mamba2":
        m = model.backbone.layers[0].mixer
        if 1 < m.n_groups < m.num_heads:
            model = arch.tiny_model(variant, seed=seed, dtype=torch.float32, n_groups=1)
    return model.to(device)


def recurrent_variants(plugin: str) -> list[str]:
    """The plugin's tiny variants without attention layers (the hybrids: test_fla_hybrid.py)."""
    return [v for v in get_plugin(plugin).tiny_variants if v != "attn"]


def specla_logits(plugin, model, ids):
    """specla's logits at every position of ``ids`` [B, T], two ways: ``score`` (whole sequences
    from an empty state) and a verified chain (the first token prefilled, the rest one chain).
    Returns both, [B, T, vocab] each (the chain's from its root on)."""
    B, T = ids.shape[0], ids.shape[1] - 1
    adapter = get_plugin(plugin).make_adapter(model, SpecConfig(num_draft_tokens=T, max_depth=T))
    scored = adapter.score(ids)
    adapter.prefill([[int(t)] for t in ids[:, 0]])
    parents = torch.arange(-1, T - 1, device=ids.device).expand(B, T).contiguous()
    chain = adapter.verify(DraftTree(ids[:, 1:].contiguous(), parents, torch.full((B,), T, device=ids.device)))
    return scored, chain.logits


@pytest.mark.parametrize("plugin,variant", [(p, v) for p in PLUGINS for v in recurrent_variants(p)])
def test_logits_equal_flas_forward(plugin, variant):
    """Every position's logits, scored and verified as a chain, equal FLA's forward over the same
    tokens, both of FLA's kernels where its layer picks one (GDN: ``fused_recurrent`` under
    no_grad, ``chunk`` with grad; GLA: ``chunk`` above 64 tokens)."""
    model = fla_model(plugin, variant, seed=1)
    T = 65 if (plugin, variant) == ("gla", "base") else 11
    ids = torch.randint(0, model.config.vocab_size, (2, T), generator=torch.Generator().manual_seed(2))
    ids = ids.to(model.device)
    refs = [(fla_forward_logits(model, ids, chunk=chunk), chunk or T > 64)
            for chunk in ((False, True) if plugin == "gdn" else (False,))]
    for ours in specla_logits(plugin, model, ids):
        for ref, chunked in refs:
            tol = CUDA_CHUNKED_ATOL if chunked and model.device.type == "cuda" else ATOL
            assert float((ours - ref).abs().max()) < tol


@pytest.mark.parametrize("plugin", PLUGINS)
def test_tree_nodes_equal_flas_forward_on_their_root_paths(plugin):
    """Each node of one verified tree (two branches, a depth-2 path, a second root child) has
    FLA's logits after the prompt and the node's root path."""
    model = fla_model(plugin, "base", seed=4)
    prompt = [3, 9, 27, 17]
    tree = DraftTree.from_lists([([5, 6, 7, 8, 9], [-1, 0, 0, 2, -1])], device=model.device)
    adapter = get_plugin(plugin).make_adapter(model, SpecConfig())
    adapter.prefill([prompt])
    logits = adapter.verify(tree).logits[0]
    paths = [[]] + [[int(tree.tokens[0, j]) for j in tree.path(0, i)] for i in range(5)]
    for row, path in enumerate(paths):
        ref = fla_forward_logits(model, torch.tensor([prompt + path]))[0, -1]
        assert float((logits[row] - ref).abs().max()) < ATOL


SPECULATION = {  # drafts from FLA's own greedy continuation, some right, some wrong
    # every other draft wrong: about one token accepted every other step
    "chains": dict(pattern="alternating", config=dict(num_draft_tokens=4, max_depth=4, top_k=1), accepted=0.4),
    # a wrong first child with its own subtree beside the right chain
    "trees": dict(pattern="tree", config=dict(num_draft_tokens=6, max_depth=4, top_k=2), accepted=1.0),
}
# per plugin and shape: a variant and seed whose greedy outputs vary (tiny random models often
# repeat one token)
DECODED = {("gdn", "chains"): ("base", 5), ("gdn", "trees"): ("no_conv", 5),
           ("gla", "chains"): ("base", 3), ("gla", "trees"): ("clamp_nogate", 7),
           ("mamba2", "chains"): ("base", 3), ("mamba2", "trees"): ("odd", 7)}


@pytest.mark.parametrize("shape", list(SPECULATION))
@pytest.mark.parametrize("plugin", PLUGINS)
def test_speculative_greedy_equals_flas_greedy(plugin, shape):
    """specla's speculative greedy output for a ragged batch equals FLA's greedy decoding token
    for token, with drafts accepted and rejected along chains or trees."""
    variant, seed = DECODED[plugin, shape]
    model = fla_model(plugin, variant, seed)
    V, new = model.config.vocab_size, 8
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (2, 7)]
    refs = [fla_greedy_generate(model, p, new) for p in prompts]
    assert len({t for r in refs for t in r}) > 4, refs  # an oracle that repeats one token tells little
    spec = SPECULATION[shape]
    out = specla.run(model, plugin, prompts=prompts, drafter=OracleDrafter(prompts, refs, spec["pattern"], V),
                     config=dict(max_new_tokens=new, **spec["config"]))
    assert out.outputs == refs and out.stats.mean_accepted_tokens > spec["accepted"]
