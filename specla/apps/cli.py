"""Command line: ``specla demo | generate | bench | train-drafter | plugins``.

Arguments are parsed, and checked where no model is needed, before torch and the plugins are
imported (only the subcommands that run import them): ``--help``, ``--version`` and argument
errors answer at once."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import secrets
import shlex
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

from pydantic import ValidationError

from ..config import EngineOptions, SpecConfig, nest_engine_options, validation_message
from ..errors import GenerationInterrupted, SpecError
from .paths import not_a_file, unwritable

# generate shows a progress bar (on a terminal, or with --progress) from this many tokens per
# prompt: the default 64 and other short completions end within seconds and print nothing more
PROGRESS_FROM_TOKENS = 256


# specla bench's note where provenance() finds no commit (an installed copy)
NO_CHECKOUT = ("specla is not run from its git checkout (an editable install or the source tree), so the "
               "report records no commit (meta.commit is null; meta.versions names specla's version) and "
               "uncommitted changes are not checked")
# the most bytes a --config file is read up to
CONFIG_LIMIT = 1 << 20
# make_drafter's rule, said once for every --drafter flag
_DRAFTER_RULE = "a name is never read as a folder: give a folder named like a drafter as ./ngram"


def _auto_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


# the flag that sets each SpecConfig field (dotted location), for errors about a value typed as one
_FLAG_OF_FIELD = {"max_new_tokens": "--max-new-tokens", "num_draft_tokens": "--num-draft-tokens",
                  "max_depth": "--max-depth", "top_k": "--tree-top-k", "dtype": "--dtype", "device": "--device",
                  "temperature": "--temperature", "top_p": "--top-p", "sampling_top_k": "--top-k", "seed": "--seed",
                  "stop_token_ids": "--stop-token-id", "engine.commit": "--commit"}


def _spec_config(base: dict, overrides: dict | None, flags: dict, engine_flags: dict | None = None,
                 source: str = "--config") -> SpecConfig:
    """``SpecConfig`` from defaults, then ``--config``'s fields, then the flags given (``None``:
    not given), each later one winning; ``engine_flags`` set fields of its ``engine`` over
    ``--config``'s.

    Raises:
        ValueError: a value SpecConfig refuses, in one line that names a value given by a flag
            by that flag (``--tree-top-k``, not ``top_k``), and one from ``--config`` by ``source``
            (:func:`config_source`) and its field.
    """
    given = {k: v for k, v in flags.items() if v is not None}
    fields = {**base, **(overrides or {}), **given}
    engine = {k: v for k, v in (engine_flags or {}).items() if v is not None}
    if engine:
        fields["engine"] = {**fields.get("engine", {}), **engine}
    try:
        return SpecConfig(**fields)
    except ValidationError as err:
        flagged = [*given, *(f"engine.{k}" for k in engine)]
        raise ValueError(validation_message(err, {k: _FLAG_OF_FIELD[k] for k in flagged},
                                            {k: source for k in overrides or {} if k not in given})) from None


def _checkpoint_dir(model: str) -> Path:
    """``--model`` as a checkpoint directory, checked before anything loads
    (:func:`specla.hf.checkpoint_dir`, the API's check, naming the flag)."""
    from ..hf import checkpoint_dir

    return checkpoint_dir(model, f"--model {model}")


def _tokenizer_dir(model: Path, tokenizer: str | None) -> Path:
    """The tokenizer directory for text prompts: ``--tokenizer DIR`` (checked by
    :func:`specla.hf.tokenizer_dir`), else the checkpoint's."""
    from ..hf import tokenizer_dir

    if tokenizer is None:
        if not (model / "tokenizer.json").is_file():
            raise ValueError(f"--model {model} has no tokenizer (no tokenizer.json in it): pass --tokenizer DIR")
        return model
    return tokenizer_dir(tokenizer)


@contextlib.contextmanager
def _transformers_bars(show: bool) -> Iterator[None]:
    """transformers' own progress bars (its "Loading weights") follow a command's rule for
    specla's bars: with ``show`` false they are hidden, then restored."""
    from transformers.utils import logging as hf_logging

    hide = not show and hf_logging.is_progress_bar_enabled()
    if hide:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if hide:
            hf_logging.enable_progress_bar()


def _load_tokenizer(directory: Path):
    from transformers.utils import logging as hf_logging

    from ..hf import load_tokenizer

    # loaded before the model: transformers would warn that it does not know the model type,
    # which the plugin registers only when it loads the model
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return load_tokenizer(directory)
    finally:
        hf_logging.set_verbosity(verbosity)


def stop_string_ids(tokenizer, stops: list[str]) -> list[int]:
    """The token id of each ``--stop`` string: each must be exactly one token of ``tokenizer``
    (encoded on its own, without special tokens), since generation stops on token ids.

    Args:
        tokenizer: a transformers tokenizer; stops: the ``--stop`` texts, in order.
    Raises:
        ValueError: a string that encodes to no token or to several (the message gives its ids).
    """
    ids = []
    for text in stops:
        enc = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        if len(enc) != 1:
            raise ValueError(f"--stop {text!r} is {len(enc)} tokens {enc} for this tokenizer; --stop takes text "
                             "that is exactly one token (pass token ids with --stop-token-id)")
        ids.append(enc[0])
    return ids


_ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth")


def _nth(flag: str, index: int) -> str:
    """``"the first --prompt"``: a repeated flag's value named by its position (``index`` from 0)."""
    n = index + 1
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"the {_ORDINALS[index] if index < len(_ORDINALS) else f'{n}{suffix}'} {flag}"


def _text_argument(flag: str, index: int, text: str) -> str:
    """A text flag's value as the tokenizer reads it: ``sys.argv`` holds bytes that do not decode
    in the locale's encoding as lone surrogates, which are decoded here as UTF-8.

    Raises:
        ValueError: bytes that are not UTF-8 text (the message names the flag and the bytes).
    """
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8")
    except UnicodeError as err:
        raise ValueError(f"{_nth(flag, index)} is not UTF-8 text ({err})") from None


def _prompts(args: argparse.Namespace) -> list[str]:
    """``--prompt``'s texts, checked before anything loads.

    Raises:
        ValueError: an empty or whitespace-only prompt, or one that is not UTF-8 text (each named
            by its position among the ``--prompt`` flags: "the first --prompt").
    """
    prompts = [_text_argument("--prompt", i, text) for i, text in enumerate(args.prompt)]
    for i, text in enumerate(prompts):
        if not text.strip():
            raise ValueError(f"{_nth('--prompt', i)} is empty{' (only whitespace)' if text else ''}: give the text "
                             "to continue")
    return prompts


def _print_result(texts: list[str], stats, decoder) -> None:
    """Each generation, then a JSON line of the run's statistics and the config used."""
    for text in texts:
        print(text)
        print("-" * 40)
    stats = stats.to_dict()
    stats.update(device=decoder.config.device or str(decoder.adapter.device), plugin=decoder.plugin.name,
                 config=decoder.config.model_dump(mode="json"))
    print(json.dumps(stats), flush=True)


def _generate(args: argparse.Namespace) -> int:
    prompts = _prompts(args)  # before torch is imported: a typo answers at once
    stop_texts = [_text_argument("--stop", i, text) for i, text in enumerate(args.stop or [])]

    from ..api import SpecDecoder

    flags = {"max_new_tokens": args.max_new_tokens, "num_draft_tokens": args.num_draft_tokens,
             "max_depth": args.max_depth, "top_k": args.tree_top_k, "dtype": args.dtype,
             "device": args.device, "temperature": args.temperature, "top_p": args.top_p,
             "sampling_top_k": args.top_k, "seed": args.seed}
    overrides = read_config_option(args.config)
    temperature = args.temperature if args.temperature is not None else overrides.get("temperature", 0)
    sampling_only = [flag for flag, value in (("--top-k", args.top_k), ("--top-p", args.top_p)) if value is not None]
    if sampling_only and temperature == 0:  # before SpecConfig's own refusal, to name the flags
        # greedy decoding ignores them; --top-k is easily meant as the tree's --tree-top-k
        verbs, it = (("filter sampling and need", "them") if len(sampling_only) > 1
                     else ("filters sampling and needs", "it"))
        hint = "; the draft tree's children per node is --tree-top-k" if "--top-k" in sampling_only else ""
        raise ValueError(f"{' and '.join(sampling_only)} {verbs} --temperature > 0 (greedy decoding ignores "
                         f"{it}){hint}")
    engine_flags = {"commit": args.commit}
    source = config_source(args.config)
    config = _spec_config({"device": _auto_device()}, overrides, flags, engine_flags, source)  # before any load
    if config.temperature > 0 and config.seed is None:
        # drawn here rather than by the engine, which would report none: the reported config's seed
        # repeats the run (--seed). Seeded sampling takes the fixed budget policy under "auto"
        # (resolve_budget_policy): unlike the adaptive one's, its schedule does not follow timings
        flags["seed"] = secrets.randbelow(2**32)
        config = config.model_copy(update={"seed": flags["seed"]})
    _cpu_threads(args, _device_type(config.device))
    model = _checkpoint_dir(args.model)
    tokenizer = _tokenizer_dir(model, args.tokenizer)
    if args.stop_token_id is not None or args.stop is not None:
        if stop_texts:  # the config needs their ids before the decoder is built
            tokenizer = _load_tokenizer(tokenizer)
        stops = list(args.stop_token_id or []) + stop_string_ids(tokenizer, stop_texts)
        config = _spec_config({"device": _auto_device()}, overrides, {**flags, "stop_token_ids": stops}, engine_flags,
                              source)
    with _transformers_bars(sys.stderr.isatty() if args.progress is None else args.progress):
        decoder = SpecDecoder(model, args.plugin, drafter=args.drafter, config=config, tokenizer=tokenizer)
    progress = args.progress
    if progress is None:
        progress = sys.stderr.isatty() and decoder.config.max_new_tokens >= PROGRESS_FROM_TOKENS
    try:
        result = decoder.generate(prompts, progress=progress)
    except GenerationInterrupted as interrupted:
        _print_result(interrupted.texts, interrupted.stats, decoder)  # what was decoded until Ctrl-C
        print(f"specla: interrupted: the output above is what was decoded until then "
              f"({interrupted.stats.generated_tokens} tokens)", file=sys.stderr)
        return 130
    _print_result(result.texts, result.stats, decoder)
    return 0


def _cpu_threads(args: argparse.Namespace, device: str) -> None:
    """torch's CPU threads for a command that decodes on ``device``: ``--threads N``, else one
    thread on a CPU unless ``OMP_NUM_THREADS`` is set. torch's default, a thread per core,
    oversubscribes cores that other work is using, and decodes far slower there than one thread
    (README, "CPU threads", has the figures). The library itself leaves
    the process-wide pool as its caller set it; a command owns its process."""
    if args.threads is None and (device != "cpu" or "OMP_NUM_THREADS" in os.environ):
        return
    import torch

    torch.set_num_threads(args.threads or 1)


def _device_type(device: str | None) -> str:
    """``"cpu"``, ``"cuda"``...: the type of a device string (``"cuda:1"`` -> ``"cuda"``)."""
    return (device or _auto_device()).split(":")[0]


def _add_threads(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=_positive, default=None, metavar="N",
                        help="torch threads on a CPU (default: 1 unless OMP_NUM_THREADS is set; torch's own "
                             "default, a thread per core, decodes far slower on a machine whose cores are busy: README, "
                             "CPU threads)")


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    _spec_config({"device": _auto_device()}, None, {"device": args.device})  # a bad --device named as the flag
    _cpu_threads(args, _device_type(args.device))
    # a bar only on a terminal, as generate's: redirected to a file or a pipe it is noise
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    with _transformers_bars(progress):
        summary = run_demo(device=args.device, max_new_tokens=args.max_new_tokens, drafter=args.drafter,
                           progress=progress)
    print(json.dumps(summary), flush=True)
    return 0 if summary["exact_match"] else 1


def _train_drafter(args: argparse.Namespace) -> int:
    from ..api import SpecDecoder
    from .train_drafter import DrafterTrainConfig, check_output, read_texts, train_drafter

    # everything that can be checked without the target is, before it loads and before --out exists
    cfg = DrafterTrainConfig(
        steps=args.steps, batch_windows=args.batch_windows, window=args.window, max_tokens=args.max_tokens,
        distill_prompts=args.distill_prompts, lr=args.lr, ce_weight=args.ce_weight, save_every=args.save_every,
        seed=args.seed, unroll=args.unroll, num_heads=args.heads,
    )
    check_output(args.out, cfg, resume=args.resume, overwrite=args.overwrite)
    model = _checkpoint_dir(args.model)
    if not (model / "tokenizer.json").is_file():
        raise ValueError(f"--model {model} has no tokenizer (no tokenizer.json in it); train-drafter reads text")
    texts = read_texts(args.data)
    config = _spec_config({"dtype": "float32", "device": _auto_device()}, None, {"device": args.device})
    with _transformers_bars(sys.stderr.isatty()):  # bars on a terminal only, as every command's (tqdm's disable=None)
        dec = SpecDecoder(model, args.plugin, config=config)
    summary = train_drafter(dec.adapter, dec.tokenizer, args.data, args.out, cfg, resume=args.resume,
                            stop_at=args.stop_at, overwrite=args.overwrite, texts=texts)
    print(json.dumps({"out": args.out, "windows": summary["windows"], "stopped_at": summary.get("stopped_at"),
                      "last_logged_loss": summary["log"][-1]["loss"] if summary["log"] else None}))
    return 0


def _bench(args: argparse.Namespace) -> int:
    from .bench import checkout_root, format_table, load_prompts, provenance, run_bench

    config = _spec_config({"max_new_tokens": 256, "device": _auto_device()}, read_config_option(args.config),
                          {"max_new_tokens": args.max_new_tokens, "device": args.device},
                          source=config_source(args.config))
    if problem := not_a_file(args.prompts):
        raise ValueError(f"--prompts {args.prompts}: {problem}")
    _cpu_threads(args, _device_type(config.device))
    if args.out:  # found before decoding, not after
        out = Path(args.out).resolve()
        if not out.parent.is_dir():
            raise ValueError(f"--out {args.out}: directory {out.parent} does not exist")
        if out.is_dir():
            raise ValueError(f"--out {args.out}: is a directory; name the report's file")
        if problem := unwritable(out):
            raise ValueError(f"--out {args.out}: not writable ({problem})")
    # the user's input first, then the checkout: a report of uncommitted code is refused before decoding
    load_prompts(args.prompts, args.limit)
    meta = provenance(config.device, root=checkout_root(), allow_dirty=args.allow_dirty,
                      command=shlex.join(["specla", *args.argv]))
    if meta["commit"] is None:  # an installed copy: --allow-dirty's help promises a check that cannot run here
        print(f"specla: note: {NO_CHECKOUT}", file=sys.stderr)
    with _transformers_bars(sys.stderr.isatty()):  # bars on a terminal only (run_bench's tqdm: disable=None)
        report = run_bench(args.model, args.drafter, args.prompts, config=config, limit=args.limit,
                           batch_size=args.batch_size, plugin=args.plugin, time_limit_s=args.time_limit,
                           execute_code=args.execute_code)
    print(format_table(report))
    if args.out:
        try:
            Path(args.out).write_text(json.dumps({"meta": meta, **report}, indent=1))
        except OSError as e:  # the table above is all that is left of the run
            raise ValueError(f"--out {args.out}: the report could not be written ({e.strerror}); the table above "
                             "is the run's only record") from None
    return 0


def _plugins(args: argparse.Namespace) -> int:
    from .. import registry

    infos, failed = registry.plugin_infos(), registry.failed_plugins()
    w = max([len("name"), *(len(p.name) for p in infos + failed)])
    print(f"{'name':<{w}} {'distribution':<24} {'version':<10} model types")
    for p in infos:
        notes = f"  ({'; '.join(p.notes)})" if p.notes else ""
        print(f"{p.name:<{w}} {p.distribution:<24} {p.version:<10} {', '.join(p.model_types)}{notes}")
    if failed:  # a listing: the broken plugins are shown, and the command still succeeds
        print("\nfailed to load (skipped):")
        for p in failed:
            print(f"{p.name:<{w}} {p.distribution:<24} {p.version:<10} {p.error}")
    return 0


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None


def _at_least(low: int):
    """An argparse type: an integer ``>= low``."""
    def parse(text: str) -> int:
        value = _integer(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    return parse


_positive, _non_negative = _at_least(1), _at_least(0)


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive finite number of seconds, got {text}")
    return value


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be finite, got {text}")
    return value


def config_source(text: str | None) -> str:
    """How errors name a ``--config`` value: ``--config`` for inline JSON (or none), else
    ``--config FILE``."""
    return "--config" if text is None or text.lstrip()[:1] in "{[" else f"--config {text}"


def read_config_option(text: str | None) -> dict:
    """The fields given by ``--config`` (``generate`` and ``bench``): a JSON object of
    :class:`~specla.config.SpecConfig` fields, inline (text starting with ``{``) or the path of a
    file holding it; ``None`` (not given) is ``{}``. The fields themselves are checked when the
    config is built, after the command's flags have overridden them; the flat engine keys of
    earlier releases move into ``engine`` here (:func:`~specla.config.nest_engine_options`), so
    that the flags can override them.

    Args:
        text: the ``--config`` value, or ``None``.
    Raises:
        ValueError: a file that does not exist, is not a regular file, is over
            :data:`CONFIG_LIMIT` bytes or cannot be read, text that is not JSON (the
            message names the file, if any, and the JSON problem), JSON that is not an object,
            or flat engine keys together with ``engine``.
    """
    if text is None:
        return {}
    source = config_source(text)
    inline = source == "--config"
    if inline:
        body = text
    else:
        if problem := not_a_file(text):
            hint = " (inline JSON starts with '{')" if problem == "no such file" else ""
            raise ValueError(f"{source}: {problem}{hint}")
        try:
            with open(text, "rb") as fh:
                data = fh.read(CONFIG_LIMIT + 1)
            if len(data) > CONFIG_LIMIT:  # a config is a few fields; past this it is the wrong file
                raise ValueError(f"{source}: larger than {CONFIG_LIMIT >> 20} MiB, not a config")
            body = data.decode("utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"{source}: cannot be read ({err})") from None
    try:
        value = json.loads(body)
    except json.JSONDecodeError as err:
        raise ValueError(f"{source}: not valid JSON ({err})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{source} must be a JSON object of SpecConfig fields, got {type(value).__name__}")
    return nest_engine_options(value)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` to each option's help (argparse shows nothing for an option
    without help text, so every option has some); options whose default is ``None`` or ``False``
    say in their help what leaving them out does, instead of ``(default: None)``."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False or "(default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


def _at_least_3(text: str) -> int:
    value = _integer(text)
    if value < 3:  # the two-step unrolled loss needs two targets after the first token
        raise argparse.ArgumentTypeError(f"must be >= 3, got {value}")
    return value


def _spec_default(field: str):
    """A SpecConfig field's default, for help texts of flags whose own default is "not given"."""
    return SpecConfig.model_fields[field].default


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line argument error, as every other error of the command line; the
    usage block argparse would print first is what ``--help`` shows, and the line points there.
    Subcommand parsers are of its subclass :class:`_SubcommandParser`."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _SubcommandParser(_Parser):
    """A subcommand's parser, which reports the arguments it does not know itself (``specla
    generate: error: unrecognized arguments: ...``): argparse hands a subcommand's leftovers back
    to the top-level parser, whose error would name ``specla`` and its --help."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


def build_parser() -> argparse.ArgumentParser:
    """The ``specla`` argument parser."""
    parser = _Parser(prog="specla", description="Speculative decoding for linear-attention models")
    parser.add_argument("--version", action="version", version=f"specla {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_SubcommandParser)
    config_help = ("SpecConfig fields as a JSON object, inline ('{\"temperature\": 0.8}') or the path of a file "
                   "holding one (a regular file of at most 1 MiB); the flags of this command override its fields")

    gen = sub.add_parser("generate", help="decode prompts with a checkpoint directory", formatter_class=_HelpFormatter,
                         description="Decode text prompts speculatively; prints each generation, then a JSON line "
                                     "of run statistics (with the config used).")
    # flags that set SpecConfig fields leave the range checks to SpecConfig, as for --config's fields
    gen.add_argument("--model", required=True, metavar="DIR", help="checkpoint directory (transformers format)")
    gen.add_argument("--prompt", action="append", required=True, metavar="TEXT",
                     help="prompt text (repeat for a batch)")
    gen.add_argument("--plugin", default=None, help="architecture plugin (default: detected from config.json)")
    gen.add_argument("--drafter", default="ngram", help="ngram, a drafter directory (specla train-drafter), or a "
                     "model's own drafter its plugin names (mtp: the MTP layer Qwen3.5 / Qwen3-Next and Nemotron-H "
                     "checkpoints ship); " + _DRAFTER_RULE)
    gen.add_argument("--tokenizer", default=None, metavar="DIR",
                     help="tokenizer directory (default: the checkpoint's own tokenizer.json)")
    gen.add_argument("--config", default=None, metavar="JSON|FILE", help=config_help)
    gen.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available)")
    _add_threads(gen)
    gen.add_argument("--dtype", default=None, choices=["float32", "float64", "bfloat16", "float16"],
                     help="(default: the model's, but a half-precision checkpoint runs in float32 on a CPU)")
    gen.add_argument("--max-new-tokens", type=_integer, default=None, metavar="N",
                     help=f"tokens generated per prompt (default: {_spec_default('max_new_tokens')})")
    gen.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                     help="show a progress bar of the generated tokens and tokens/s on stderr (default: when "
                          f"stderr is a terminal and --max-new-tokens is at least {PROGRESS_FROM_TOKENS})")
    samp = gen.add_argument_group("sampling (all need --temperature > 0, except --seed)")
    samp.add_argument("--temperature", type=_number, default=None, metavar="T",
                      help="0 decodes greedily; above 0 samples losslessly from softmax(logits / T) "
                           f"(default: {_spec_default('temperature')})")
    samp.add_argument("--top-p", type=_number, default=None, metavar="P",
                      help="keep the smallest set of most likely tokens whose probability reaches P "
                           f"(default: {_spec_default('top_p')}, all)")
    samp.add_argument("--top-k", type=_integer, default=None, metavar="K",
                      help="keep only the K most likely tokens (0: all; default: "
                           f"{_spec_default('sampling_top_k')}); not the draft tree's width, which is --tree-top-k")
    samp.add_argument("--seed", type=_integer, default=None, metavar="N",
                      help="sampling seed: the same seed repeats a run (default: a fresh random seed, which "
                           "the final JSON line's config reports)")
    stop = gen.add_argument_group("stopping (a stop token is kept in the output; the model's eos_token_id also "
                                  "stops unless --config sets stop_at_eos to false)")
    stop.add_argument("--stop-token-id", type=_integer, action="append", default=None, metavar="ID",
                      help="end a sequence after it emits this token id (repeatable; with --stop, replaces "
                           "--config's stop_token_ids)")
    stop.add_argument("--stop", action="append", default=None, metavar="TEXT",
                      help="end a sequence after it emits this text, which must be exactly one token of the "
                           "tokenizer (an error names its tokens otherwise); repeatable")
    tree = gen.add_argument_group("draft tree")
    tree.add_argument("--num-draft-tokens", type=_integer, default=None, metavar="N",
                      help="draft budget per step (0: plain autoregressive decoding; default: "
                           f"{_spec_default('num_draft_tokens')})")
    tree.add_argument("--max-depth", type=_integer, default=None, metavar="D",
                      help=f"most draft tokens on one path (default: {_spec_default('max_depth')})")
    tree.add_argument("--tree-top-k", type=_integer, default=None, metavar="K",
                      help=f"children per draft node (1: chains; default: {_spec_default('top_k')}); "
                           "SpecConfig's top_k")
    tree.add_argument("--commit", default=None, choices=["factor", "snapshot", "replay"],
                      help="how the accepted path reaches the state (default: "
                           f"{EngineOptions.model_fields['commit'].default})")
    gen.set_defaults(func=_generate)

    demo = sub.add_parser("demo", help="run the bundled tiny target on bundled prompts, against autoregressive",
                          formatter_class=_HelpFormatter,
                          description="Progress goes to stderr (on a terminal, or with --progress); generations, "
                                      "then a JSON summary line, to stdout.")
    demo.add_argument("--device", default=None, help="cpu, cuda (default: cuda if available)")
    _add_threads(demo)
    demo.add_argument("--max-new-tokens", type=_positive, default=96, metavar="N", help="tokens generated per prompt")
    demo.add_argument("--drafter", default="ngram", help="ngram, eagle (shipped with the demo target) or a drafter "
                      "directory; " + _DRAFTER_RULE)
    demo.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                      help="show a progress bar on stderr (default: when stderr is a terminal)")
    demo.set_defaults(func=_demo)

    tr = sub.add_parser("train-drafter", help="train an EAGLE drafter on a target's own features",
                        formatter_class=_HelpFormatter,
                        description="Options, --out and the data files are all checked before the target loads "
                                    "and before anything is written.")
    tr.add_argument("--model", required=True, metavar="DIR", help="target checkpoint directory (with tokenizer)")
    tr.add_argument("--data", nargs="+", required=True, metavar="FILE",
                    help="JSONL or JSONL.xz files, rows with 'text' (else 'prompt')")
    tr.add_argument("--out", required=True, metavar="DIR",
                    help="drafter directory (pass it as --drafter / drafter=); refused if it already holds a "
                         "drafter, unless --resume or --overwrite")
    tr.add_argument("--plugin", default=None, help="architecture plugin (default: detected from config.json)")
    tr.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available)")
    tr.add_argument("--steps", type=_positive, default=2000, metavar="N",
                    help="optimiser steps in all (with --resume, may exceed the checkpoint's run)")
    tr.add_argument("--batch-windows", type=_positive, default=32, metavar="N", help="training windows per step")
    tr.add_argument("--window", type=_at_least_3, default=128, metavar="T",
                    help="tokens per training window (>= 3 and >= unroll + 1)")
    tr.add_argument("--max-tokens", type=_non_negative, default=400_000, metavar="N",
                    help="teacher-forced corpus tokens")
    tr.add_argument("--distill-prompts", type=_non_negative, default=256, metavar="N",
                    help="prompts continued by the target (self-distillation; 0: none)")
    tr.add_argument("--lr", type=_number, default=1e-3, help="peak AdamW learning rate")
    tr.add_argument("--ce-weight", type=_number, default=1.0, metavar="W",
                    help="weight of the token cross-entropy term")
    tr.add_argument("--unroll", type=_positive, default=3, metavar="K", help="draft levels the loss is unrolled over")
    tr.add_argument("--heads", type=_non_negative, default=None, metavar="H",
                    help="attention heads (0: no attention; default: hidden size / 64)")
    tr.add_argument("--save-every", type=_positive, default=500, metavar="N",
                    help="steps between checkpoints (OUT/checkpoint.pt)")
    tr.add_argument("--seed", type=_integer, default=0, help="data order and initialisation")
    mode = tr.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true",
                      help="continue from OUT/checkpoint.pt, to the same or a larger --steps (the other options, "
                           "except --save-every, must match the checkpoint's; without a checkpoint: from step 0)")
    mode.add_argument("--overwrite", action="store_true",
                      help="replace the drafter in OUT (its files are removed once the data has been checked)")
    tr.add_argument("--stop-at", type=_positive, default=None, metavar="N",
                    help="checkpoint and stop after this step (finish with --resume; default: run to --steps)")
    tr.set_defaults(func=_train_drafter)

    bench = sub.add_parser("bench", help="a prompt suite, speculative against autoregressive",
                           formatter_class=_HelpFormatter,
                           description="Decode a JSONL prompt suite speculatively and autoregressively (specla's "
                                       "own plain decoding, same prefill), side by side; prints a table per "
                                       "category (tokens/s, speedup, acceptance, exact-match rate) and with --out "
                                       "writes the JSON report.")
    bench.add_argument("--model", required=True, metavar="DIR", help="checkpoint directory (transformers format)")
    bench.add_argument("--drafter", default="ngram", help="ngram, a drafter directory (specla train-drafter), or a "
                       "model's own drafter its plugin names (mtp); " + _DRAFTER_RULE)
    bench.add_argument("--prompts", required=True, metavar="FILE",
                       help="JSONL, a row per prompt: prompt; optional: id (kept in the report's samples), "
                            "category, answer (GSM8K: scored), test and entry_point (HumanEval: run with "
                            "--execute-code)")
    bench.add_argument("--limit", type=_positive, default=None, metavar="N",
                       help="decode only this many prompts, taken round-robin over the categories (default: all)")
    bench.add_argument("--config", default=None, metavar="JSON|FILE", help=config_help)
    bench.add_argument("--max-new-tokens", type=_positive, default=None, metavar="N",
                       help="tokens generated per prompt (default: 256)")
    bench.add_argument("--batch-size", type=_positive, default=1, metavar="B",
                       help="prompts decoded together (batches never mix categories)")
    bench.add_argument("--time-limit", type=_positive_seconds, default=None, metavar="S",
                       help="seconds: start no new batch after this; the first batch always runs, and the "
                            "untimed warm-up comes on top (the longest prompt at every graph batch, each size's first "
                            "batch). The report counts the prompts decoded. Default: no limit")
    bench.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available)")
    _add_threads(bench)
    bench.add_argument("--plugin", default=None, help="architecture plugin (default: detected from config.json)")
    bench.add_argument("--out", default=None, metavar="FILE", help="write the JSON report here, with a 'meta' "
                       "block: commit, device, library versions, date, command (default: none)")
    bench.add_argument("--execute-code", action="store_true",
                       help="score HumanEval rows (with 'test' and 'entry_point') by running the prompts file's "
                            "code and the model's completion in an isolated subprocess with an empty environment "
                            "and a timeout, not a sandbox: only for prompts files you trust (default: not run)")
    bench.add_argument("--allow-dirty", action="store_true",
                       help="run from a specla checkout with uncommitted changes (refused otherwise); the report's "
                            "commit then reads <sha>+dirty. The check applies only when specla runs from its "
                            "checkout (an editable install or the source tree): an installed copy records no "
                            "commit, and a note on stderr says so")
    bench.set_defaults(func=_bench)
    plug = sub.add_parser("plugins", help="list registered architecture plugins",
                          description="List the registered architecture plugins, the model types each runs (with the "
                                      "plugin auto-detection picks where several run one), and the plugins that "
                                      "failed to load, with the error.")
    plug.set_defaults(func=_plugins)
    return parser


def _version() -> str:
    """The installed distribution's version (the package's own when run from a source tree)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("specla")
    except PackageNotFoundError:
        from .. import __version__

        return __version__


def _format_warning(message, category, filename, lineno, line=None) -> str:
    """specla's own warnings as one line (``specla: warning: ...``), as its errors are; other
    libraries' warnings as Python formats them, with their source line. Only how a warning is
    printed changes: recorded warnings (``pytest.warns``, ``catch_warnings(record=True)``) and
    filters are untouched."""
    if category.__module__ == SpecError.__module__:
        return f"specla: warning: {message}\n"
    return _FORMAT_WARNING(message, category, filename, lineno, line)


_FORMAT_WARNING = warnings.formatwarning


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``specla`` console script. Errors exit with one line on stderr: 2 for
    a user's mistake, 130 for Ctrl-C (``generate`` first prints what it decoded until then). A
    reader that closes stdout early (``specla generate ... | head``) ends the command quietly with
    141, the status of a process killed by SIGPIPE, as Unix tools end."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else [str(a) for a in argv]  # the command a report records
    try:
        warnings.formatwarning = _format_warning
        code = args.func(args)
        if sys.stdout is not None:  # None where the process started with stdout closed (>&-)
            sys.stdout.flush()  # a closed pipe raises here, in the handler below, rather than at exit
        return code
    except KeyboardInterrupt:
        parser.exit(130, "specla: interrupted\n")
    except BrokenPipeError:
        # 128 + SIGPIPE, as a shell reports `yes | head`: not 1, which `specla demo` returns for a
        # mismatch. What stdout still buffers goes to devnull, or the interpreter's flush at exit
        # raises again (the recipe of Python's signal module docs)
        with contextlib.suppress(OSError, ValueError):  # a stdout without a file descriptor (tests)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except ValidationError as err:
        # user mistakes (bad paths, options, prompts) get one line, not a traceback
        parser.exit(2, f"specla: error: {validation_message(err)}\n")
    except (SpecError, OSError, RuntimeError, ValueError) as err:
        # ValueError covers malformed JSON (configs, prompt files) and bad argument values
        parser.exit(2, f"specla: error: {err}\n")
    finally:
        warnings.formatwarning = _FORMAT_WARNING


if __name__ == "__main__":
    sys.exit(main())
