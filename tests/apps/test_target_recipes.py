"""The trained-target recipes of ``benchmarks/targets`` at a CPU size: the Qwen3.5-architecture
hybrid trains, its MTP layer trains on it, and ``drafter="mtp"`` reads the written layer and
decodes exactly like plain decoding."""

import json
import lzma
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import specla
from specla.errors import DrafterError

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "plugins" / "fla" / "assets" / "tiny"
FILES = ("python_stdlib", "python_docs", "linux_docs", "sharegpt_chat", "gsm8k_train")


def _corpus(directory: Path) -> Path:
    """Five corpus files of 60 random-word documents (every 50th held out by the recipe)."""
    rng = random.Random(0)
    words = "the state of a layer is kept and the draft tree is verified then the path is committed".split()
    directory.mkdir()
    for name in FILES:
        with lzma.open(directory / f"{name}.jsonl.xz", "wt", encoding="utf-8") as fh:
            for _ in range(60):
                fh.write(json.dumps({"source": name, "text": " ".join(rng.choices(words, k=120))}) + "\n")
    return directory


def _run(*args: str) -> None:
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_the_hybrid_recipe_trains_an_mtp_layer_that_drafts_exactly(tmp_path):
    corpus, out = _corpus(tmp_path / "corpus"), tmp_path / "hybrid"
    _run(str(ROOT / "benchmarks" / "targets" / "train_target.py"), "--preset", "tiny-hybrid", "--corpus", str(corpus),
         "--tokenizer", str(TOKENIZER), "--out", str(out), "--steps", "3", "--batch", "2", "--device", "cpu")
    _run(str(ROOT / "benchmarks" / "targets" / "train_mtp.py"), "--model", str(out), "--corpus", str(corpus),
         "--steps", "20", "--lr", "1e-2", "--batch", "4", "--window", "32", "--device", "cpu")
    trained = json.loads((out / "mtp_training.json").read_text())
    assert trained["steps"] == 20 and trained["heldout_top1_agreement"] > 0.3  # untrained: about 0
    prompts = ["the draft tree is verified then the", "the state of a layer"]  # the corpus's words
    cfg = dict(max_new_tokens=12, dtype="float32", num_draft_tokens=3, max_depth=3)
    dec = specla.SpecDecoder(str(out), drafter="mtp", tokenizer=str(out), config=cfg)
    written = load_file(str(out / "mtp.safetensors"))
    # the head loads strictly (every weight from the file, no name left over), so one weight shows which file
    torch.testing.assert_close(dec.drafter.head.fc.weight, written["mtp.fc.weight"].float(), rtol=0, atol=0)
    spec = dec.generate(prompts)
    plain = specla.run(str(out), prompts=prompts, tokenizer=str(out), config=dict(cfg, num_draft_tokens=0))
    assert spec.outputs == plain.outputs and sum(spec.stats.accepted_histogram[1:]) > 0  # drafts were accepted
    # a target retrained into the directory takes the MTP layer of the model it replaces with it
    _run(str(ROOT / "benchmarks" / "targets" / "train_target.py"), "--preset", "tiny-hybrid", "--corpus", str(corpus),
         "--tokenizer", str(TOKENIZER), "--out", str(out), "--steps", "1", "--batch", "2", "--device", "cpu")
    assert not (out / "mtp.safetensors").exists() and not (out / "mtp_training.json").exists()
    with pytest.raises(DrafterError, match="holds none"):
        specla.SpecDecoder(str(out), drafter="mtp", config=cfg)
