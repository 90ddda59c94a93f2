"""Held-out loss of a GDN checkpoint, with the same windows as the training recipe.

    python benchmarks/targets/eval_target.py --model plugins/fla/assets/tiny --corpus ../shared/data/corpus

Runs specla's reference path (CPU or GPU) in float32; prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_target import heldout_starts, token_stream  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--windows", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from specla import SpecConfig, SpecDecoder

    dec = SpecDecoder(args.model, None, config=SpecConfig(dtype="float32", device=args.device))
    tok = AutoTokenizer.from_pretrained(args.model)
    held = token_stream(args.corpus, tok, "heldout")
    starts = heldout_starts(held, args.seq_len, args.windows)
    losses = []
    with torch.no_grad():
        for i in range(0, len(starts), 16):
            x = torch.from_numpy(np.stack([held[s : s + args.seq_len + 1] for s in starts[i : i + 16]]).astype(np.int64))
            logits = dec.adapter.score(x[:, :-1])
            losses.append(float(F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten().to(logits.device))))
    print(json.dumps({"model": args.model, "heldout_loss": float(np.mean(losses)), "heldout_tokens_scored":
                      len(starts) * args.seq_len, "heldout_tokens": len(held)}))


if __name__ == "__main__":
    main()
