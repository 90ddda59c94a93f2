"""Command line: ``specla demo | generate | bench | train-drafter | plugins``."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

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


def _train_drafter(args: argparse.Namespace) -> int:
    import torch

    from .api import SpecDecoder
    from .drafters.training import DrafterTrainConfig, train_drafter

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dec = SpecDecoder(args.model, args.plugin, config=SpecConfig(dtype="float32", device=device))
    if dec.tokenizer is None:
        raise OSError(f"{args.model} has no tokenizer files; train-drafter reads text")
    cfg = DrafterTrainConfig(
        steps=args.steps, batch_windows=args.batch_windows, window=args.window, max_tokens=args.max_tokens,
        distill_prompts=args.distill_prompts, lr=args.lr, ce_weight=args.ce_weight, save_every=args.save_every,
        seed=args.seed, unroll=args.unroll, num_heads=args.heads,
    )
    summary = train_drafter(dec.adapter, dec.tokenizer, args.data, args.out, cfg, resume=args.resume,
                            stop_at=args.stop_at)
    print(json.dumps({"out": args.out, "windows": summary["windows"], "stopped_at": summary.get("stopped_at"),
                      "last_logged_loss": summary["log"][-1]["loss"] if summary["log"] else None}))
    return 0


def _bench(args: argparse.Namespace) -> int:
    import torch

    from .bench import format_table, run_bench

    overrides = {}
    if args.config:  # inline JSON or a JSON file
        text = args.config if args.config.lstrip()[:1] in "{[" else Path(args.config).read_text()
        try:
            overrides = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"--config: not valid JSON ({err})") from None
        if not isinstance(overrides, dict):
            raise ValueError("--config must be a JSON object of SpecConfig fields")
    flags = {k: v for k, v in (("max_new_tokens", args.max_new_tokens), ("device", args.device)) if v is not None}
    config = SpecConfig(**{"max_new_tokens": 256, "device": "cuda" if torch.cuda.is_available() else "cpu",
                           **overrides, **flags})  # explicit flags win over --config
    if args.out and not Path(args.out).resolve().parent.is_dir():  # found before decoding, not after
        raise ValueError(f"--out {args.out}: directory {Path(args.out).resolve().parent} does not exist")
    report = run_bench(args.model, args.drafter, args.prompts, config=config, limit=args.limit,
                       batch_size=args.batch_size, plugin=args.plugin, time_limit_s=args.time_limit)
    print(format_table(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


def _plugins(args: argparse.Namespace) -> int:
    infos = registry.plugin_infos()
    print(f"{'name':<10} {'distribution':<24} {'version':<10} model types")
    for p in infos:
        print(f"{p.name:<10} {p.distribution:<24} {p.version:<10} {', '.join(p.model_types)}")
    return 0


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None


def _positive(text: str) -> int:
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive finite number of seconds, got {text}")
    return value


def _at_least_3(text: str) -> int:
    value = _integer(text)
    if value < 3:  # the two-step unrolled loss needs two targets after the first token
        raise argparse.ArgumentTypeError(f"must be >= 3, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``specla`` argument parser."""
    parser = argparse.ArgumentParser(prog="specla", description="Speculative decoding for linear-attention models")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="decode prompts with a checkpoint directory")
    gen.add_argument("--model", required=True, help="checkpoint directory (transformers format)")
    gen.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    gen.add_argument("--plugin", default=None, help="architecture plugin (default: detect from config.json)")
    gen.add_argument("--drafter", default="ngram", help="ngram (default) or a drafter directory (specla train-drafter)")
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
    demo.add_argument("--drafter", default="ngram", help="ngram, eagle (shipped with the demo target) or a directory")
    demo.set_defaults(func=_demo)
    tr = sub.add_parser("train-drafter", help="train an EAGLE drafter on a target's own features",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    tr.add_argument("--model", required=True, help="target checkpoint directory (with tokenizer)")
    tr.add_argument("--data", nargs="+", required=True, help="JSONL(.xz) files with 'text' or 'prompt'")
    tr.add_argument("--out", required=True, help="drafter directory (pass it as --drafter / drafter=)")
    tr.add_argument("--plugin", default=None)
    tr.add_argument("--device", default=None)
    tr.add_argument("--steps", type=_positive, default=2000)
    tr.add_argument("--batch-windows", type=_positive, default=32)
    tr.add_argument("--window", type=_at_least_3, default=128,
                    help="tokens per training window (>= 3 and >= unroll + 1)")
    tr.add_argument("--max-tokens", type=int, default=400_000, help="teacher-forced corpus tokens")
    tr.add_argument("--distill-prompts", type=int, default=256, help="prompts continued by the target")
    tr.add_argument("--lr", type=float, default=1e-3)
    tr.add_argument("--ce-weight", type=float, default=1.0, help="weight of the token cross-entropy term")
    tr.add_argument("--unroll", type=_positive, default=3, help="draft levels the loss is unrolled over")
    tr.add_argument("--heads", type=int, default=None, help="attention heads (default hidden/64; 0: no attention)")
    tr.add_argument("--save-every", type=_positive, default=500)
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    tr.add_argument("--stop-at", type=_positive, default=None, help="checkpoint and stop after this step")
    tr.set_defaults(func=_train_drafter)
    bench = sub.add_parser("bench", help="a prompt suite, speculative against autoregressive")
    bench.add_argument("--model", required=True)
    bench.add_argument("--drafter", default="ngram", help="ngram or a drafter directory (specla train-drafter)")
    bench.add_argument("--prompts", required=True, help="JSONL with id, category, prompt (+ answer / test)")
    bench.add_argument("--limit", type=_positive, default=None,
                       help="decode only this many prompts, taken round-robin over the categories")
    bench.add_argument("--config", default=None, help="SpecConfig fields as JSON (inline or a file)")
    bench.add_argument("--max-new-tokens", type=_positive, default=None, help="default 256")
    bench.add_argument("--batch-size", type=_positive, default=1,
                       help="prompts decoded together (batches never mix categories)")
    bench.add_argument("--time-limit", type=_positive_seconds, default=None,
                       help="seconds: start no new batch after this (the first batch always runs; the untimed "
                            "warm-up on the first batch comes on top; the report counts the prompts decoded)")
    bench.add_argument("--device", default=None)
    bench.add_argument("--plugin", default=None)
    bench.add_argument("--out", default=None, help="write the JSON report here")
    bench.set_defaults(func=_bench)
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
    except (SpecError, OSError, RuntimeError, ValueError) as err:
        # ValueError covers malformed JSON (configs, prompt files) and bad argument values
        parser.exit(2, f"specla: error: {err}\n")


if __name__ == "__main__":
    sys.exit(main())
