"""Train the MTP layer of a trained Qwen3.5-architecture target (``train_target.py --preset
small-hybrid``), so that ``drafter="mtp"`` has the layer real Qwen3.5 checkpoints ship.

    python benchmarks/targets/train_mtp.py --model OUT/small-hybrid --corpus ../shared/data/corpus \
        --steps 1500

The target is frozen. The layer is the one ``plugins/qwen/mtp.py`` runs (``QwenMTPHead``: ``fc``
over the normed embedding of token ``t + 1`` and the target's final-normed feature at ``t``, one
decoder layer of the model's full-attention kind at position ``t``, a norm, the target's LM head),
trained over whole windows at once (causal attention over the earlier pairs) to match the
target's own next-token distribution at ``t + 1`` (soft cross-entropy: what the target will
verify, so what acceptance rewards). Only the first draft level is trained, on the target's
features and the true tokens; deeper levels, which read the layer's own output back, are not
(Qwen's MTP layers are trained the same way, one level deep). The EAGLE trainer also regresses
features and unrolls several levels.
Writes ``mtp.safetensors`` (``mtp.*`` tensors, the checkpoint's dtype) into the model directory,
where ``drafter="mtp"`` reads them, and ``mtp_training.json`` (losses, top-1 agreement with the
target on held-out windows).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_target import SEED, check_streams, heldout_starts, lr_at, token_stream, windows  # noqa: E402


def mtp_logits(head, text, lm_head, x: torch.Tensor):
    """``(mtp_logits [B, T-1, V], target_logits [B, T-1, V])`` for windows ``x [B, T]``: the
    layer's prediction from the pair (feature at ``t``, token ``t + 1``), and the target's logits
    at ``t + 1`` (its distribution of token ``t + 2``), the target frozen."""
    from specla.testing.transformers_oracle import torch_path
    from specla_qwen.spec import rotary_cos_sin

    with torch.no_grad(), torch_path(text):
        f = text(input_ids=x, use_cache=False).last_hidden_state  # final-normed features
        target = lm_head(f[:, 1:]).float()
        emb = text.embed_tokens(x[:, 1:])
    T = x.shape[1] - 1
    h = head.pair(f[:, :-1], emb)
    pos = torch.arange(T, device=x.device)[None].expand(x.shape[0], T)
    cos_sin = rotary_cos_sin(text.rotary_emb, h, pos)
    mask = torch.full((T, T), float("-inf"), device=x.device, dtype=h.dtype).triu(1)[None, None]
    attn = head.layers[0].self_attn

    def attend(y):
        return attn(hidden_states=y, position_embeddings=cos_sin, attention_mask=mask)[0]

    return lm_head(head.run(h, attend)).float(), target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a train_target.py hybrid checkpoint directory")
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=32, help="windows per step")
    ap.add_argument("--window", type=int, default=256, help="tokens per window")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--max-docs", type=int, default=None, help="use only this many documents (smoke runs)")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds: probe the throughput, then train as many steps as fit (recorded; --steps "
                         "is then ignored)")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    for flag, low in (("steps", 1), ("batch", 1), ("window", 2), ("time_budget", 1)):
        if getattr(args, flag) is not None and getattr(args, flag) < low:
            ap.error(f"--{flag.replace('_', '-')} must be at least {low}, got {getattr(args, flag)}")
    config_file = Path(args.model) / "config.json"
    if not config_file.is_file():
        raise SystemExit(f"--model {args.model}: no config.json there (a train_target.py hybrid checkpoint directory)")
    saved = json.loads(config_file.read_text())
    model_type = saved.get("model_type")
    if model_type not in ("qwen3_5_text", "qwen3_5"):
        raise SystemExit(f"--model {args.model}: model_type {model_type!r}; the MTP layer is trained for Qwen3.5 "
                         "models (train_target.py --preset small-hybrid or tiny-hybrid)")

    from safetensors.torch import save_file
    from specla_qwen.spec import text_parts
    from specla_qwen.mtp import QwenMTPHead
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = True
    tok = AutoTokenizer.from_pretrained(args.model)
    save_dtype = getattr(torch, saved.get("dtype") or saved.get("torch_dtype") or "bfloat16")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa")
    model.to(dev).eval().requires_grad_(False)
    text, lm_head = text_parts(model)
    torch.manual_seed(SEED)
    head = QwenMTPHead(model, None).to(dev).train()
    train, held = (token_stream(args.corpus, tok, split, args.max_docs) for split in ("train", "heldout"))
    L, rng = args.window, np.random.default_rng(SEED)
    check_streams(train, held, L)

    def batch_at(stream: np.ndarray, starts: np.ndarray) -> torch.Tensor:
        return windows(stream, starts, L + 1, dev)

    def loss_of(x: torch.Tensor) -> tuple[torch.Tensor, float]:
        logits, target = mtp_logits(head, text, lm_head, x)
        p = target.softmax(-1)
        loss = -(p * logits.log_softmax(-1)).sum(-1).mean()
        agree = float((logits.argmax(-1) == target.argmax(-1)).float().mean())
        return loss, agree

    if args.time_budget:
        # throughput probe: forward and backward of a few batches, no optimiser step (the layer and
        # the data order are untouched); the chosen count is recorded, and --steps N reproduces the run
        probe_rng, times = np.random.default_rng(SEED + 1), []
        for _ in range(4):
            t0 = time.time()
            loss_of(batch_at(train, probe_rng.integers(0, len(train) - L - 1, args.batch)))[0].backward()
            torch.cuda.synchronize() if dev.type == "cuda" else None
            times.append(time.time() - t0)
        head.zero_grad(set_to_none=True)
        args.steps = max(int(args.time_budget / float(np.median(times[1:]))), 20)
        print(f"probe: {np.median(times[1:]):.3f} s/step -> {args.steps} steps in {args.time_budget:.0f} s", flush=True)
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = dict(lr=args.lr, warmup=max(args.steps // 20, 1), steps=args.steps)
    log, start = [], time.time()  # train_seconds: the optimiser steps only
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, sched)
        loss, agree = loss_of(batch_at(train, rng.integers(0, len(train) - L - 1, args.batch)))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 100 == 0 or step == args.steps - 1 or step < 3:
            log.append({"step": step, "loss": loss.item(), "top1_agreement": agree, "elapsed_s": time.time() - start})
            print(json.dumps(log[-1]), flush=True)
    train_s = time.time() - start
    head.eval()
    starts = heldout_starts(held, L, count=64)
    with torch.no_grad():
        evals = [loss_of(batch_at(held, starts[i : i + 16])) for i in range(0, len(starts), 16)]
    held_loss, held_agree = (float(np.mean([float(e[i]) for e in evals])) for i in (0, 1))
    print(f"held-out soft cross-entropy {held_loss:.4f}, top-1 agreement with the target {held_agree:.3f}", flush=True)
    tensors = {f"mtp.{k}": v.detach().to(save_dtype).contiguous().cpu() for k, v in head.state_dict().items()}
    save_file(tensors, str(Path(args.model) / "mtp.safetensors"))
    (Path(args.model) / "mtp_training.json").write_text(json.dumps(dict(
        steps=args.steps, batch=args.batch, window=L, lr=args.lr, heldout_soft_ce=held_loss,
        heldout_top1_agreement=held_agree, train_seconds=train_s, log=log), indent=1))


if __name__ == "__main__":
    main()
