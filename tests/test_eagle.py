"""The target-aligned EAGLE drafter: exactness, persistence, training and resume (on the tiny
trained target shipped with the gdn plugin)."""

import json
import subprocess
import sys
from importlib import resources

import pytest
import torch

import specla
from specla import SpecDecoder
from specla.drafters import EagleDrafter, make_drafter
from specla.drafters.eagle import EagleHead, is_eagle_dir
from specla.drafters.training import DrafterTrainConfig, train_drafter
from specla.registry import get_plugin
from specla_gdn.naive import naive_greedy_decode

TINY = get_plugin("gdn").demo_checkpoint
TINY_EAGLE = TINY.parent / "tiny-eagle"
DATA = str(resources.files("specla").joinpath("data/demo_prompts.jsonl"))


def test_shipped_drafter_is_exact_in_float64():
    dec = SpecDecoder(TINY, None, drafter=str(TINY_EAGLE),
                      config=dict(dtype="float64", max_new_tokens=20, num_draft_tokens=8, max_depth=4, top_k=3))
    assert isinstance(dec.drafter, EagleDrafter)
    prompts = ["Question: Tom has 3 apples and buys 5 more. How many apples does he have?\nAnswer:", "def add(a, b):"]
    result = dec.generate(prompts)
    ids = [dec.tokenizer(p)["input_ids"] for p in prompts]
    assert result.outputs == [naive_greedy_decode(dec.model, i, len(o)) for i, o in zip(ids, result.outputs)]
    assert result.stats.mean_accepted_tokens > 0  # the trained drafter does get drafts accepted


def test_head_roundtrip_and_errors(tmp_path):
    head = EagleHead(16, 24)
    head.save(tmp_path / "d", note="x")
    assert is_eagle_dir(tmp_path / "d") and not is_eagle_dir(tmp_path)
    loaded = EagleHead.load(tmp_path / "d")
    f, e = torch.randn(3, 16), torch.randn(3, 16)
    assert torch.equal(loaded(f, e), head(f, e))
    with pytest.raises(ValueError, match="not a specla EAGLE drafter"):
        EagleHead.load(tmp_path)
    dec = SpecDecoder(TINY, None)
    with pytest.raises(ValueError, match="drafter hidden size 16 != target hidden size 256"):
        make_drafter(str(tmp_path / "d")).bind(dec.adapter)


def _train(tmp_path, name, **kw):
    dec = SpecDecoder(TINY, None, config=dict(dtype="float32"))
    cfg = DrafterTrainConfig(steps=6, batch_windows=4, window=32, max_tokens=600, distill_prompts=2,
                             distill_new_tokens=16, save_every=3, seed=1)
    return train_drafter(dec.adapter, dec.tokenizer, [DATA], tmp_path / name, cfg, log=lambda *_: None, **kw)


def test_training_resume_equals_uninterrupted(tmp_path):
    full = _train(tmp_path, "full")
    part = _train(tmp_path, "part", stop_at=3)
    assert part["stopped_at"] == 3 and not is_eagle_dir(tmp_path / "part")
    _train(tmp_path, "part", resume=True)
    a, b = EagleHead.load(tmp_path / "full"), EagleHead.load(tmp_path / "part")
    for (k, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.allclose(x, y, atol=1e-6), k
    assert full["windows"] > 0 and len(full["log"]) >= 1


def test_train_drafter_cli_and_use(tmp_path):
    out = tmp_path / "cli"
    proc = subprocess.run(
        [sys.executable, "-m", "specla.cli", "train-drafter", "--model", str(TINY), "--data", DATA, "--out", str(out),
         "--steps", "4", "--batch-windows", "4", "--window", "32", "--max-tokens", "500", "--distill-prompts", "2",
         "--device", "cpu"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["out"] == str(out)
    r = specla.run(TINY, None, prompts=["def f(x):"], drafter=str(out), config=dict(max_new_tokens=8, dtype="float32"))
    ar = specla.run(TINY, None, prompts=["def f(x):"], config=dict(max_new_tokens=8, dtype="float32", num_draft_tokens=0))
    assert r.outputs == ar.outputs


def test_bad_drafter_directories_raise_drafter_errors(tmp_path):
    from specla import DrafterError, UnknownPluginError

    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text('{"format": "specla-eagle-v1"}')
    with pytest.raises(DrafterError, match="incomplete or malformed"):
        EagleHead.load(tmp_path / "broken")
    (tmp_path / "partial").mkdir()
    (tmp_path / "partial" / "checkpoint.pt").write_bytes(b"x")
    with pytest.raises(UnknownPluginError, match="finish it with --resume"):
        make_drafter(str(tmp_path / "partial"))
    dec = SpecDecoder(TINY, None, config=dict(dtype="float32"))
    with pytest.raises(DrafterError, match="no training window"):
        train_drafter(dec.adapter, dec.tokenizer, [DATA], tmp_path / "x", DrafterTrainConfig(window=100000),
                      log=lambda *_: None)


def test_training_config_is_validated():
    from specla import DrafterError

    with pytest.raises(DrafterError, match="window must be >= 3"):
        DrafterTrainConfig(window=1)
    with pytest.raises(DrafterError, match="batch_windows must be positive"):
        DrafterTrainConfig(batch_windows=0)
