"""Build examples/tiny-random-gdn: a random-initialised Gated DeltaNet with a byte-level tokenizer.

It exists so that `specla generate` has a checkpoint to run on a fresh machine before trained
targets ship (they come with the real-target work). Its text is noise, but greedy speculative
decoding of it is exact, which is what the command shows. Deterministic: seed 0.

    python examples/make_tiny_random_gdn.py examples/tiny-random-gdn
"""

import sys
import warnings

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

warnings.filterwarnings("ignore")
from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM  # noqa: E402


def main(out: str) -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=259, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<unk>", "<s>", "</s>"]
    )
    tok.train_from_iterator([], trainer=trainer)  # bytes only: no merges
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    torch.manual_seed(0)
    cfg = GatedDeltaNetConfig(
        hidden_size=128, num_hidden_layers=2, num_heads=2, head_dim=32, expand_v=1, vocab_size=len(fast),
        bos_token_id=1, eos_token_id=2, initializer_range=0.08,
    )
    model = GatedDeltaNetForCausalLM(cfg)
    model.save_pretrained(out)
    fast.save_pretrained(out)


if __name__ == "__main__":
    main(sys.argv[1])
