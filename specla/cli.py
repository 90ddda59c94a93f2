"""Command line: ``specla demo``, ``specla generate`` and ``specla plugins``."""

from __future__ import annotations

import argparse
import json
import sys

from pydantic import ValidationError

from . import registry
from .config import SpecConfig
from .errors import SpecError


def _generate(args: argparse.Namespace) -> int:
    import torch

    from .api import SpecDecoder

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    config = SpecConfig(
        num_draft_tokens=args.num_draft_tokens,
        max_depth=args.max_depth,
        top_k=args.top_k,
        commit=args.commit,
        max_new_tokens=args.max_new_tokens,
        dtype=args.dtype,
        device=device,
    )
    decoder = SpecDecoder(args.model, args.plugin, drafter=args.drafter, config=config, tokenizer=args.tokenizer)
    result = decoder.generate(list(args.prompt))
    for text in result.texts or [str(o) for o in result.outputs]:
        print(text)
        print("-" * 40)
    stats = result.stats.to_dict()
    stats.update(device=device, plugin=decoder.plugin.name)
    print(json.dumps(stats))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    summary = run_demo(device=args.device, max_new_tokens=args.max_new_tokens, drafter=args.drafter)
    print(json.dumps(summary))
    return 0 if summary["exact_match"] else 1


def _plugins(args: argparse.Namespace) -> int:
    infos = registry.plugin_infos()
    print(f"{'name':<10} {'distribution':<24} {'version':<10} model types")
    for p in infos:
        print(f"{p.name:<10} {p.distribution:<24} {p.version:<10} {', '.join(p.model_types)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``specla`` argument parser."""
    parser = argparse.ArgumentParser(prog="specla", description="Speculative decoding for linear-attention models")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="decode prompts with a checkpoint directory")
    gen.add_argument("--model", required=True, help="checkpoint directory (transformers format)")
    gen.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    gen.add_argument("--plugin", default=None, help="architecture plugin (default: detect from config.json)")
    gen.add_argument("--drafter", default="ngram", help="drafter name (default: ngram)")
    gen.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    gen.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available)")
    gen.add_argument("--dtype", default=None, choices=["float32", "float64", "bfloat16", "float16"])
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--num-draft-tokens", type=int, default=8, help="draft budget N per step")
    gen.add_argument("--max-depth", type=int, default=8)
    gen.add_argument("--top-k", type=int, default=1, help="children per draft node (1 = chains)")
    gen.add_argument("--commit", default="factor", choices=["factor", "snapshot", "replay"])
    gen.set_defaults(func=_generate)
    demo = sub.add_parser("demo", help="run the bundled tiny target on bundled prompts, against autoregressive")
    demo.add_argument("--device", default=None, help="cpu, cuda (default: cuda if available)")
    demo.add_argument("--max-new-tokens", type=int, default=96)
    demo.add_argument("--drafter", default="ngram")
    demo.set_defaults(func=_demo)
    plug = sub.add_parser("plugins", help="list registered architecture plugins")
    plug.set_defaults(func=_plugins)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``specla`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValidationError as err:
        # user mistakes (bad paths, options, prompts) get one line, not a traceback
        fields = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg']}" for e in err.errors())
        parser.exit(2, f"specla: error: {fields}\n")
    except (SpecError, OSError, RuntimeError) as err:
        parser.exit(2, f"specla: error: {err}\n")


if __name__ == "__main__":
    sys.exit(main())
