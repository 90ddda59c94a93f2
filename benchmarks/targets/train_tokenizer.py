"""Train the byte-level BPE tokenizer of the ``tiny`` target (the Llama-2 vocabulary's 32,000 rows
would not fit the 20 MB budget of the embedded model at a useful width).

    python benchmarks/targets/train_tokenizer.py --corpus ../shared/data/corpus --vocab 8192 --out DIR

Deterministic: the training split in file order, every document truncated to 20,000 characters.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corpus import documents  # noqa: E402

SPECIALS = ["<unk>", "<s>", "</s>"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((d[:20000] for d in documents(args.corpus, "train")), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(args.out)
    print(f"vocab {len(fast)} -> {args.out}")


if __name__ == "__main__":
    main()
