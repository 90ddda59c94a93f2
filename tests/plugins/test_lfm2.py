"""The lfm2 plugin against transformers' own ``Lfm2ForCausalLM``: token identity with its greedy
decoding (no-cache forwards on the PyTorch path), the short convolution's window under trees,
recorded steps and whole-prompt prefill."""

import pytest
import torch

from specla import SpecConfig
from specla.registry import get_plugin

import transformers_checks

ARCH = get_plugin("lfm2")
V = 41


def test_the_window_follows_the_accepted_branch_only():
    """After a step whose accepted path is not the tree's first branch, the committed window is
    the last ``L - 1`` inputs along that path: a fresh prefill of the accepted tokens has the same
    windows and the same next logits (float32; equal up to the rounding of other matmul shapes)."""
    from specla.records import Acceptance
    from specla.tree import DraftTree

    model = ARCH.tiny_model("base", seed=4, dtype=torch.float32)
    cfg = SpecConfig(num_draft_tokens=4, max_depth=2)
    ad, fresh = ARCH.make_adapter(model, cfg), ARCH.make_adapter(model, cfg)
    prompt = [5, 9, 14, 2, 30]
    ad.prefill([prompt])
    tree = DraftTree.from_lists([([7, 8, 11, 12], [-1, 0, -1, 2])])  # branches 7-8 and 11-12
    out = ad.verify(tree)
    acc = Acceptance(path=torch.tensor([[0, 3, 4]]), num_accepted=torch.tensor([2]), bonus=torch.tensor([20]),
                     tokens=torch.tensor([[11, 12]]))
    ad.commit(tree, out, acc)
    ad.flush()
    fresh.prefill([prompt + [11, 12, 20]])
    from specla.mixers.shortconv.mixer import ShortConvMixer

    convs = [(a, b) for a, b in zip(ad.mixers, fresh.mixers) if isinstance(a, ShortConvMixer)]
    assert len(convs) == 2
    for a, b in convs:
        torch.testing.assert_close(a.conv, b.conv, rtol=1e-5, atol=1e-6)
    empty = DraftTree.from_lists([([], [])])
    torch.testing.assert_close(ad.verify(empty).logits, fresh.verify(empty).logits, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("variant", ARCH.tiny_variants)
def test_cuda_recorded_steps_equal_transformers_greedy(variant):
    """On a GPU, recorded CUDA-graph steps (PyTorch mixers), float32, accepted tree drafts, a
    ragged batch: every output equals transformers' greedy decoding."""
    transformers_checks.check_cuda_graphs_equal_transformers(ARCH, variant, V, kernels=False)


@pytest.mark.parametrize("variant", ARCH.tiny_variants)
def test_whole_prompt_prefill_equals_transformers_greedy(variant, monkeypatch):
    """``prefill="chunked"``: the gated short convolutions and the attention layers over whole
    prompts in one pass (any device: no kernel needed), a ragged batch, then tree drafts: outputs
    equal transformers' greedy decoding."""
    transformers_checks.check_whole_prompt_prefill_equals_transformers(ARCH, variant, V, monkeypatch, fla=False)
