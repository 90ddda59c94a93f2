"""Deterministic training recipe for specla's trained targets: GDN models (FLA's
GatedDeltaNetForCausalLM, presets ``tiny`` and ``small``) and Qwen3.5-architecture hybrids
(transformers' Qwen3_5ForCausalLM, three GDN layers to one gated attention layer, presets
``tiny-hybrid`` and ``small-hybrid``).

    python benchmarks/targets/train_target.py --preset tiny --corpus ../shared/data/corpus \
        --tokenizer plugins/fla/assets/tiny --out /tmp/tiny-target

Presets fix the architecture, the token budget (steps x batch x sequence length), the learning
rate schedule and the seed, so a rerun on the same GPU type rebuilds the same model up to
kernel-level nondeterminism. The GDN presets' forward and backward run through specla's own
differentiable PyTorch GDN path (``ModelAdapter(..., gdn_spec, differentiable=True).score``: causal conv and
the chunked WY-form gated delta rule), checked against FLA's model and sequential decoding in the
tests: FLA 0.6's training kernels refuse Hopper GPUs with Triton < 3.7.1. The hybrid presets run
transformers' own forward on its PyTorch functions (``specla.testing.transformers_oracle.torch_path``:
transformers would route the gated delta rule to FLA's kernels) with SDPA attention. Writes a
transformers checkpoint (config.json, model.safetensors, tokenizer files) and ``training.json``
(losses, held-out loss, throughput, wall time).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corpus import documents  # noqa: E402

# the `small` budget: micro-batches of 16 keep the activations of the PyTorch training path within the
# memory of the GPU the recipe ran on (docs/targets.md)
SMALL_BUDGET = dict(seq_len=1024, batch=32, micro_batch=16, steps=1000, lr=2e-3, warmup=50, amp=False,
                    save_dtype="bfloat16")
PRESETS = {
    # ~7.7M parameters with an 8k vocabulary: fits the 20 MB embedded budget in bfloat16
    "tiny": dict(
        model=dict(hidden_size=256, num_hidden_layers=6, num_heads=3, head_dim=64, expand_v=2,
                   tie_word_embeddings=True),
        seq_len=512, batch=128, steps=700, lr=3e-3, warmup=50, save_dtype="bfloat16",
    ),
    # ~119M parameters with the Llama-2 vocabulary
    "small": dict(model=dict(hidden_size=768, num_hidden_layers=12, num_heads=4, head_dim=128, expand_v=2,
                             tie_word_embeddings=True), **SMALL_BUDGET),
    # the Qwen3.5 architecture at the `small` budget: 12 layers (GDN, GDN, GDN, gated attention) x 3,
    # the GDN layers with small's key heads (4 of 128) and value width (8 heads of 128), attention
    # with 4 query and 2 key/value heads of 128 and Qwen3.5's partial rotary (a quarter of each head)
    "small-hybrid": dict(arch="qwen3_5", model=dict(
        hidden_size=768, num_hidden_layers=12, intermediate_size=2048, num_attention_heads=4, num_key_value_heads=2,
        head_dim=128, linear_num_key_heads=4, linear_key_head_dim=128, linear_num_value_heads=8,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, tie_word_embeddings=True), **SMALL_BUDGET),
    # a CPU-sized hybrid for checking the recipe (one full-attention layer among three GDN layers)
    "tiny-hybrid": dict(arch="qwen3_5", model=dict(
        hidden_size=64, num_hidden_layers=4, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, linear_num_key_heads=2, linear_key_head_dim=32, linear_num_value_heads=2,
        linear_value_head_dim=32, linear_conv_kernel_dim=4, tie_word_embeddings=True),
        seq_len=128, batch=8, steps=50, lr=3e-3, warmup=5, save_dtype="float32"),
}
SEED = 0


def token_stream(corpus: str, tokenizer, split: str, max_docs: int | None = None) -> np.ndarray:
    """Every document of ``split`` tokenized, joined with EOS, as one int32 array."""
    docs = [d for d, _ in zip(documents(corpus, split), range(max_docs or 10**9))]
    ids = tokenizer(docs, add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    return np.fromiter((t for seq in ids for t in (*seq, eos)), dtype=np.int32)


def check_streams(train: np.ndarray, held: np.ndarray, seq_len: int) -> None:
    """Refuse (``SystemExit``, before any training) streams too short for one window of
    ``seq_len + 1`` tokens."""
    for name, stream in (("training", train), ("held-out", held)):
        if len(stream) < seq_len + 3:
            raise SystemExit(f"the {name} split has {len(stream):,} tokens, fewer than one window of {seq_len + 1} "
                             "(more documents, --max-docs, or a shorter window)")


def heldout_starts(held: np.ndarray, seq_len: int, count: int = 128) -> np.ndarray:
    """Start offsets of ``count`` evaluation windows spread evenly over the held-out stream (so
    every corpus file is represented)."""
    return np.linspace(0, len(held) - seq_len - 2, count).astype(np.int64)


def windows(stream: np.ndarray, starts: np.ndarray, length: int, device: torch.device) -> torch.Tensor:
    """``[len(starts), length]`` int64 token windows of ``stream`` beginning at ``starts``, on
    ``device``."""
    return torch.from_numpy(np.stack([stream[s : s + length] for s in starts]).astype(np.int64)).to(device)


def lr_at(step: int, cfg: dict) -> float:
    """Linear warm-up then cosine decay to 10% of the peak."""
    if step < cfg["warmup"]:
        return cfg["lr"] * (step + 1) / cfg["warmup"]
    t = (step - cfg["warmup"]) / max(cfg["steps"] - cfg["warmup"], 1)
    return cfg["lr"] * (0.1 + 0.45 * (1 + math.cos(math.pi * t)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), required=True)
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=None, help="override the preset (smoke runs)")
    ap.add_argument("--batch", type=int, default=None, help="override the preset (smoke runs)")
    ap.add_argument("--max-docs", type=int, default=None, help="use only this many documents (smoke runs)")
    ap.add_argument("--amp", action="store_true", default=None,
                    help="bfloat16 autocast for the matmuls (the state and gates stay float32); overrides the preset")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds: probe the throughput, then train as many steps as fit (recorded)")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    for flag in ("steps", "batch"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            ap.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")

    import fla  # noqa: F401
    import transformers
    from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM
    from transformers import AutoTokenizer

    from specla import SpecConfig
    from specla.testing.transformers_oracle import torch_path
    from specla.model.adapter import ModelAdapter
    from specla_fla.gdn import gdn_spec

    cfg = dict(PRESETS[args.preset])
    if args.steps is not None:
        cfg["steps"] = args.steps
    if args.batch is not None:
        cfg["batch"] = args.batch
    if args.amp is not None:
        cfg["amp"] = args.amp
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    t0 = time.time()
    train = token_stream(args.corpus, tok, "train", args.max_docs)
    held = token_stream(args.corpus, tok, "heldout", args.max_docs)
    print(f"tokens: train {len(train):,} heldout {len(held):,} ({time.time() - t0:.0f}s)", flush=True)
    check_streams(train, held, cfg["seq_len"])

    arch = cfg.get("arch", "gdn")
    config_cls, model_cls = {"gdn": (GatedDeltaNetConfig, GatedDeltaNetForCausalLM),
                             "qwen3_5": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM)}[arch]
    model_cfg = config_cls(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                           **cfg["model"])
    if arch == "qwen3_5":
        model_cfg._attn_implementation = "sdpa"
    dev = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = True
    L, Bsz = cfg["seq_len"], cfg["batch"]
    micro = min(cfg.get("micro_batch", Bsz), Bsz)  # gradient accumulation keeps activations in memory
    if Bsz % micro:
        raise SystemExit(f"batch {Bsz} is not a multiple of micro_batch {micro}")

    def batch_at(stream: np.ndarray, starts: np.ndarray) -> torch.Tensor:
        return windows(stream, starts, L + 1, dev)

    def loss_of(model, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cfg.get("amp", False)):
            if arch == "gdn":
                # rebuilt every step: the adapter's fused weights (e.g. q|k|v) are views of this step's params
                logits = ModelAdapter(model, SpecConfig(), gdn_spec, differentiable=True).score(x[:, :-1])
            else:
                with torch_path(model):
                    logits = model(x[:, :-1], use_cache=False).logits
        return F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())

    def run_recipe(steps: int, log: list):
        """The recipe: seeded model, data order and schedule for ``steps`` optimiser steps."""
        torch.manual_seed(SEED)
        rng = np.random.default_rng(SEED)
        model = model_cls(model_cfg).to(dev)
        decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
        other = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                                lr=cfg["lr"], betas=(0.9, 0.95))
        model.train()
        run = dict(cfg, steps=steps)
        start = time.time()
        for step in range(steps):
            for group in opt.param_groups:
                group["lr"] = lr_at(step, run)
            x = batch_at(train, rng.integers(0, len(train) - L - 1, Bsz))
            total = 0.0
            for part in x.split(micro):
                loss = loss_of(model, part)
                (loss * (part.shape[0] / Bsz)).backward()
                total += loss.item() * part.shape[0] / Bsz
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step % 100 == 0 or step == steps - 1 or step < 3:
                log.append({"step": step, "loss": total, "elapsed_s": time.time() - start})
                print(json.dumps(log[-1]), flush=True)
        return model, time.time() - start

    if args.time_budget:
        # throughput probe on a throwaway run, then the step count that fits the budget; the
        # chosen count is recorded, and --steps N alone reproduces the run
        probe: list = []
        run_recipe(4, probe)
        per_step = (probe[-1]["elapsed_s"] - probe[1]["elapsed_s"]) / 2
        cfg["steps"] = max(int(args.time_budget / per_step), cfg["warmup"] + 1)
        print(f"probe: {per_step:.2f} s/step -> {cfg['steps']} steps in {args.time_budget:.0f} s", flush=True)
        torch.cuda.empty_cache() if dev.type == "cuda" else None
    log: list = []
    model, train_s = run_recipe(cfg["steps"], log)
    model.eval()
    held_starts = heldout_starts(held, L)
    with torch.no_grad():
        held_loss = float(np.mean([float(loss_of(model, batch_at(held, held_starts[i : i + micro])))
                                   for i in range(0, len(held_starts), micro)]))
    print(f"held-out loss {held_loss:.4f}, train {train_s:.0f}s", flush=True)
    for stale in ("mtp.safetensors", "mtp_training.json"):  # an MTP layer trained on a model this one replaces
        if (Path(args.out) / stale).exists():
            (Path(args.out) / stale).unlink()
            print(f"removed {stale} from {args.out}: it was trained on the model this run replaces", flush=True)
    model.to(getattr(torch, cfg["save_dtype"])).save_pretrained(args.out)
    tok.save_pretrained(args.out)
    n_params = sum(p.numel() for p in model.parameters())
    summary = dict(preset=args.preset, config=cfg, parameters=n_params, train_tokens=len(train),
                   heldout_tokens=len(held), heldout_loss=held_loss, train_seconds=train_s,
                   tokens_per_s=cfg["steps"] * Bsz * L / train_s,
                   device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                   log=log)
    (Path(args.out) / "training.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
