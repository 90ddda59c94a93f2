"""transformers glue: checking and loading a transformers-format checkpoint directory and
refusing weights that do not fit it, refusing pickles that hold more than tensors in one line,
loading a tokenizer directory, the end-of-sequence ids a model's generation stops at, and the hook
cycles of a model specla owns (loaded or copied by it)."""

from __future__ import annotations

import contextlib
import inspect
import logging
import pickle
import re
import warnings
from collections.abc import Iterator
from numbers import Integral
from pathlib import Path

import torch
from torch import Tensor

from .errors import UnsupportedModelError

# weight names an error shows of each kind; the count says how many there are
_SHOWN = 3

# the files a tokenizer's vocabulary is read from: a fast tokenizer's serialization, or a slow
# one's vocabulary (BPE's vocab.json, WordPiece's vocab.txt, SentencePiece, tiktoken)
TOKENIZER_FILES = ("tokenizer.json", "vocab.*", "*.model", "*.tiktoken")


def _count(kind: str, names: list[str]) -> str:
    """``"15 missing from the files (a, b, c, ...)"``: the count and the first few names."""
    more = ", ..." if len(names) > _SHOWN else ""
    return f"{len(names)} {kind} ({', '.join(names[:_SHOWN])}{more})"


class _DropLoadReport(logging.Filter):
    """Drops transformers' table of missing, unexpected and reshaped weights: :func:`load_pretrained`
    raises an error that names them whenever there is one to show."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in record.getMessage()


@contextlib.contextmanager
def _without_load_report() -> Iterator[None]:
    logger, dropped = logging.getLogger("transformers.modeling_utils"), _DropLoadReport()
    logger.addFilter(dropped)
    try:
        yield
    finally:
        logger.removeFilter(dropped)


@contextlib.contextmanager
def tensors_only(what: str, error: type[Exception], advice: str) -> Iterator[None]:
    """Runs ``torch.load(..., weights_only=True)`` calls (direct, or transformers') so that a
    pickle they refuse is reported in one line, not with torch's several lines of advice to load
    it unsafely.

    Args:
        what: names the file, as the message's subject (``"--resume: out/checkpoint.pt"``).
        error: the specla error class raised.
        advice: what the user can do instead, ending the message.
    Raises:
        error: ``"{what} holds objects other than tensors, and specla loads no such file (loading
            it could run code); {advice}"`` for a pickle torch's weights-only unpickler refuses
            for an object it names; for one it cannot read at all, the message says so.
    Torch's ``UserWarning`` that such a pickle's protocol is not its default is not shown: the
    error says all there is to do.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
        try:
            yield
        except pickle.UnpicklingError as err:
            # torch names the object it refuses ("Unsupported global"); an instruction it does not
            # read (protocol 4's framing, or bytes that are no pickle) hides whatever the file holds
            found = ("holds objects other than tensors" if "Unsupported global" in str(err) else
                     "cannot be read by torch's tensors-only loader (it holds objects other than tensors, or was "
                     "written with pickle protocol 4 or later)")
            raise error(f"{what} {found}, and specla loads no such file (loading it could run code); "
                        f"{advice}") from err


def _refuse_weights_far_short_of_config(model_class, path: Path) -> None:
    """Refuses a checkpoint whose weight files hold far fewer elements than the model its
    ``config.json`` describes, before transformers builds that model in full (a config.json
    without the model's sizes gives the class's defaults: billions of parameters).
    The model is built on the meta device (no memory) and only the safetensors headers are read.
    Twice what the files hold leaves room for renamed, fused, tied (counted once) or ignored
    weights; :func:`load_pretrained`'s check after loading is the precise one. A directory
    without safetensors files, a quantized checkpoint (several weights in one stored element) or
    a model that cannot be built on the meta device is not checked here.

    Args:
        model_class: a transformers model class or Auto class.
        path: the checkpoint directory.
    Raises:
        UnsupportedModelError: the model needs more than twice the elements the files hold; the
            message names the directory and both counts.
    """
    import math

    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        return
    if hasattr(model_class, "from_config"):  # an Auto class: the config names the model class
        from transformers import AutoConfig

        config, build = AutoConfig.from_pretrained(str(path)), model_class.from_config
    else:
        config, build = model_class.config_class.from_pretrained(str(path)), model_class._from_config
    if getattr(config, "quantization_config", None):
        return
    try:
        with torch.device("meta"):
            needed = sum(param.numel() for param in build(config).parameters())
    except Exception:  # noqa: BLE001  a model whose construction needs real tensors: the check after loading
        return
    held = 0
    for file in files:
        with safe_open(str(file), "pt") as weights:
            held += sum(math.prod(weights.get_slice(name).get_shape()) for name in weights.keys())
    if needed > 2 * held:
        raise UnsupportedModelError(f"{path}: its config.json describes a model of {needed / 1e6:.1f}M parameters, "
                                    f"its weight files hold {held / 1e6:.1f}M: the model would run on random "
                                    "weights (a config.json missing the model's sizes?)")


def load_pretrained(model_class, path: Path, *, dtype: torch.dtype | None) -> torch.nn.Module:
    """``model_class.from_pretrained(path)`` (``dtype`` ``None``: the checkpoint's own), refusing a
    checkpoint whose weights do not fill the model its ``config.json`` describes: transformers
    gives such a model random weights where the file has none (``num_hidden_layers`` larger than
    the weights, a renamed tensor), drops weights it has no place for, and only logs a report.
    What transformers itself accounts for is not counted: weights tied to another
    (``tie_word_embeddings``), and the keys the model class declares ignorable.

    Args:
        model_class: a transformers model class or Auto class.
        path: the checkpoint directory.
        dtype: the dtype to load in.
    Raises:
        UnsupportedModelError: as :func:`_refuse_weights_far_short_of_config`, before loading;
            weights missing from the files, unexpected in them, or of another shape than the
            config gives; the message names the directory and, for each kind, the count and the
            first few names (sorted).
    """
    _refuse_weights_far_short_of_config(model_class, path)
    # mismatched shapes are kept as a report rather than transformers' RuntimeError, whose text
    # does not name the tensors
    with _without_load_report():
        model, info = model_class.from_pretrained(str(path), dtype=dtype or "auto", output_loading_info=True,
                                                  ignore_mismatched_sizes=True)
    shapes = [f"{name}: {list(file)} in the files, {list(want)} in the model"
              for name, file, want in sorted(info["mismatched_keys"])]
    problems = [_count(kind, names) for kind, names in (("missing from the files", sorted(info["missing_keys"])),
                                                        ("in the files but not in the model",
                                                         sorted(info["unexpected_keys"])),
                                                        ("of another shape", shapes)) if names]
    if problems:
        raise UnsupportedModelError(f"{path}: its weights do not fit its config.json (the model would run on "
                                    f"random or dropped weights): {'; '.join(problems)}")
    return model


def checkpoint_dir(path: str | Path, name: str | None = None) -> Path:
    """``path`` as a checkpoint directory (one holding a ``config.json``), checked before
    anything loads; the Python API and the command line both ask here, so they word it alike.

    Args:
        path: the directory (a leading ``~`` is the home directory); name: how the messages name
            it (default: ``path`` itself; the command line's ``"--model PATH"``).
    Returns:
        the directory, ``~`` expanded.
    Raises:
        UnsupportedModelError: ``"{name} does not exist"`` (where it reads as a Hugging Face Hub
            id, ``owner/name``, followed by how to fetch it: specla loads local directories), ``"{name}
            is a file, not a checkpoint directory"``, ``"{name} is not a checkpoint directory (no
            config.json in it)"``, or an empty path.
    """
    if not str(path):  # Path("") is the working directory: name the mistake, not "."
        raise UnsupportedModelError("the model path is empty")
    hub_id = isinstance(path, str) and re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", path) is not None
    path, name = Path(path).expanduser(), str(path) if name is None else name
    if not path.exists():
        if hub_id:
            raise UnsupportedModelError(
                f"{name} does not exist (if it is a Hugging Face Hub id: specla loads checkpoints from local "
                f"directories; download it first, `hf download {path} --local-dir DIR`, or load it with "
                "transformers and pass the model)")
        raise UnsupportedModelError(f"{name} does not exist")
    if not path.is_dir():
        raise UnsupportedModelError(f"{name} is a file, not a checkpoint directory")
    if not (path / "config.json").is_file():
        raise UnsupportedModelError(f"{name} is not a checkpoint directory (no config.json in it)")
    return path


def tokenizer_dir(directory: str | Path) -> Path:
    """``directory`` as a tokenizer directory, checked before anything loads: transformers,
    given a directory without a vocabulary, raises a multi-line error, or with a checkpoint's
    config.json alone, builds an empty tokenizer.

    Raises:
        FileNotFoundError: ``directory`` is empty, does not exist, is a file (the message names
            the directory holding it), or holds none of :data:`TOKENIZER_FILES` (the message
            names the directory and the files looked for).
    """
    if not str(directory):
        raise FileNotFoundError("the tokenizer directory path is empty")
    path = Path(directory).expanduser()
    if path.is_file():  # tokenizer.json itself, as users often name it
        raise FileNotFoundError(f"tokenizer directory {directory} is a file: give the directory holding it "
                                f"({path.parent})")
    if not path.is_dir():
        raise FileNotFoundError(f"tokenizer directory {directory} does not exist")
    if not any(next(path.glob(pattern), None) for pattern in TOKENIZER_FILES):
        raise FileNotFoundError(f"tokenizer directory {directory} holds no tokenizer (no "
                                f"{', '.join(TOKENIZER_FILES[:-1])} or {TOKENIZER_FILES[-1]} file in it)")
    return path


def load_tokenizer(directory: str | Path):
    """The transformers tokenizer saved in ``directory`` (``AutoTokenizer.from_pretrained``).

    Raises:
        FileNotFoundError: as :func:`tokenizer_dir`.
    """
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir(directory)))


def eos_token_ids(model: torch.nn.Module) -> tuple[int, ...]:
    """The end-of-sequence ids a model's generation stops at, as transformers' ``generate`` reads
    them: ``model.generation_config.eos_token_id`` (filled from the checkpoint's
    ``generation_config.json`` when it has one) when set, else ``model.config.eos_token_id``.
    Either may be one id or a list of ids.

    Args:
        model: a transformers-style model (``generation_config`` and ``config`` are optional).
    Returns:
        The ids in their given order without repeats; ``()`` when neither is set.
    Raises:
        UnsupportedModelError: an id that is not an integer (a bool, a float, a string...).
    """
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    source = "generation_config"
    if eos is None:
        eos = getattr(getattr(model, "config", None), "eos_token_id", None)
        source = "config"
    if eos is None:
        return ()
    ids = eos.tolist() if isinstance(eos, Tensor) else eos
    ids = list(ids) if isinstance(ids, (list, tuple)) else [ids]
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, Integral):
            raise UnsupportedModelError(f"{source}.eos_token_id must be an int or a list of ints, got {eos!r}")
    return tuple(dict.fromkeys(int(t) for t in ids))


def weaken_hook_cycles(model: torch.nn.Module) -> torch.nn.Module:
    """Make the hooks of ``model``'s modules that are bound methods of one of its modules hold
    that module weakly, as torch's own ``with_module`` hooks do; each is called as before. A
    module's own bound method in its hook table is a reference cycle (transformers' and FLA's
    ``Mamba2Model`` register ``self.load_hook`` as a ``load_state_dict`` pre-hook), which keeps
    the whole model alive after its last user drops it, until Python's cyclic garbage collector
    runs. Only for models specla owns (loaded or copied by it).

    Returns:
        ``model``, changed in place.
    """
    from torch.nn.modules.module import _WrappedHook

    owners = {id(m) for m in model.modules()}
    for module in model.modules():
        tables = [t for name, t in vars(module).items() if name.endswith("hooks") and isinstance(t, dict)]
        for table in tables:
            for key, hook in table.items():
                fn = hook.hook if isinstance(hook, _WrappedHook) and not hook.with_module else hook
                if inspect.ismethod(fn) and id(fn.__self__) in owners:
                    table[key] = _WrappedHook(fn.__func__, fn.__self__)
    return model
