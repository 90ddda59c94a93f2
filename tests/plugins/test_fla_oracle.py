"""specla's PyTorch model path against FLA's own model (its Triton kernels, run on the CPU by the
Triton interpreter): an oracle nobody on this project wrote. FLA has no float64 kernels, so these
compare float32 runs at float32 tolerance."""

import pytest
import torch

import specla
from specla import DraftTree, SpecConfig
from specla.registry import get_plugin
from conftest import MODEL_CONFIGS, make_model
import os

if os.environ.get("TRITON_INTERPRET") != "1":  # e.g. the GPU run, which compares in test_gpu.py
    pytest.skip("FLA runs its real kernels in this process (TRITON_INTERPRET != 1)", allow_module_level=True)

from fla_oracle import enable_fla_interpreter, fla_forward_logits, fla_greedy_generate  # noqa: E402

enable_fla_interpreter()
ATOL = 2e-4  # float32 end to end, several layers, two different summation orders


def chain_logits(model, ids):
    """Our logits at every position of ``ids`` [B, T]: prefill the first token, verify the rest as a chain."""
    adapter = get_plugin("gdn").make_adapter(model, SpecConfig(num_draft_tokens=ids.shape[1], max_depth=ids.shape[1]))
    adapter.prefill([[int(t)] for t in ids[:, 0]])
    T = ids.shape[1] - 1
    tree = DraftTree(ids[:, 1:].contiguous(), torch.arange(-1, T - 1).expand(ids.shape[0], T).contiguous(),
                     torch.full((ids.shape[0],), T))
    return adapter.verify(tree).logits


@pytest.mark.parametrize("name", list(MODEL_CONFIGS))
def test_model_forward_equals_fla(name):
    model = make_model(name, dtype=torch.float32, seed=1)
    ids = torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(2))
    ours = chain_logits(model, ids)
    for chunk in (False, True):  # FLA's fused_recurrent and chunk kernels
        ref = fla_forward_logits(model, ids, chunk=chunk)
        assert float((ours - ref).abs().max()) < ATOL


def test_tree_nodes_equal_fla_on_their_root_paths():
    model = make_model("gva", dtype=torch.float32, seed=4)
    prompt = [3, 9, 27, 17]
    tree = DraftTree.from_lists([([5, 6, 7, 8, 9], [-1, 0, 0, 2, -1])])
    adapter = get_plugin("gdn").make_adapter(model, SpecConfig())
    adapter.prefill([prompt])
    logits = adapter.verify(tree).logits[0]
    ref = fla_forward_logits(model, torch.tensor([prompt]))[0, -1]
    assert float((logits[0] - ref).abs().max()) < ATOL
    for i in range(5):
        path = [int(tree.tokens[0, j]) for j in tree.path(0, i)]
        ref = fla_forward_logits(model, torch.tensor([prompt + path]))[0, -1]
        assert float((logits[i + 1] - ref).abs().max()) < ATOL


def test_greedy_speculative_equals_fla_greedy():
    model = make_model("base", dtype=torch.float32, seed=5)
    prompt = [7, 8, 9, 7, 8, 9, 7, 8]
    result = specla.run(model, "gdn", prompts=[prompt], config=dict(max_new_tokens=10, top_k=2))
    assert result.outputs[0] == fla_greedy_generate(model, prompt, 10)
