"""GPU cases (skipped without CUDA): the reference path on CUDA, and FLA's real Triton kernels as
the oracle. Run on a GPU machine with ``TRITON_INTERPRET=0 python -m pytest tests/test_gpu.py``."""

import os

import pytest
import torch

import specla
from specla import DraftTree, SpecConfig
from specla.registry import get_plugin
from specla_gdn.naive import naive_greedy_decode
from conftest import make_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(autouse=True)
def exact_fp32_matmul():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.parametrize("name", ["base", "gva", "odd_nogate"])
@pytest.mark.parametrize("commit", ["factor", "snapshot", "replay", "triton-serial", "triton-parallel",
                                    "triton-hybrid"])
def test_cuda_token_identical(name, commit):
    """Reference path (each commit strategy) and the compiled Triton kernels (factor commit, each
    verify kernel) against the naive sequential decoder."""
    model = make_model(name, dtype=torch.float32, seed=2)  # stays on the CPU for the naive oracle
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(3)
    motif = torch.randint(0, V, (6,), generator=g).tolist()
    prompts = [motif * 3, torch.randint(0, V, (9,), generator=g).tolist(), [motif[0]]]
    cfg = dict(device="cuda", max_new_tokens=24, top_k=2, commit=commit)
    if commit.startswith("triton-"):
        cfg.update(commit="factor", kernels="triton", verify_kernel=commit.split("-")[1])
        if cfg["verify_kernel"] == "serial":
            cfg["top_k"] = 1  # chains
    result = specla.run(model, "gdn", prompts=prompts, config=cfg)
    assert result.outputs == [naive_greedy_decode(model, p, 24) for p in prompts]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs FLA's compiled kernels")
@pytest.mark.parametrize("name", ["base", "expand_v2", "gva"])
def test_cuda_verify_equals_fla_kernels(name):
    model = make_model(name, dtype=torch.float32, seed=1).cuda()
    ids = torch.randint(0, model.config.vocab_size, (2, 23), generator=torch.Generator().manual_seed(2)).cuda()
    T = ids.shape[1] - 1
    adapter = get_plugin("gdn").make_adapter(model, SpecConfig(num_draft_tokens=T, max_depth=T))
    adapter.prefill([[int(t)] for t in ids[:, 0]])
    tree = DraftTree(ids[:, 1:].contiguous(), torch.arange(-1, T - 1, device="cuda").expand(2, T).contiguous(),
                     torch.full((2,), T, device="cuda"))
    ours = adapter.verify(tree).logits
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits.float()
    # FLA's kernels may use TF32 dots: compare at that precision
    assert float((ours - ref).abs().max()) < 2e-3 * max(1.0, float(ref.abs().max()))


def test_cuda_demo_and_eagle_drafter_are_exact():
    from specla.demo import run_demo

    for drafter in ("ngram", "eagle"):
        summary = run_demo(device="cuda", max_new_tokens=48, drafter=drafter, echo=lambda *_: None)
        assert summary["exact_match"] is True and summary["device"] == "cuda"
        print(drafter, summary)  # the GPU run's figures, for the closing note
