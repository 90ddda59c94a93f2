"""User-facing options, validated with pydantic v2."""

from __future__ import annotations

import math
import operator
import sys
import warnings
from pathlib import Path
from typing import Literal, get_args

import pydantic
from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_serializer, field_validator, model_validator

from .errors import ConfigDeprecationWarning

CommitStrategy = Literal["factor", "snapshot", "replay"]
DType = Literal["float32", "float64", "bfloat16", "float16"]


def _as_int(value):
    """A NumPy (or other ``__index__``) integer as an ``int``; anything else as given, for the
    strict integer fields to accept or refuse (pydantic's lax mode would take ``True``, ``"8"``
    and ``8.0``)."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        return value
    try:
        return operator.index(value)
    except TypeError:  # an array that is not one integer
        return value


_INTEGER_FIELDS = ("num_draft_tokens", "max_depth", "top_k", "sampling_top_k", "seed", "max_new_tokens")

MAX_DRAFT_TOKENS = 64
"""The largest draft budget ``N`` and depth ``D`` a run accepts. Trees up to 63 drafts (64 nodes
with the root) verify in one 64-row tile of every plugin's parallel kernel and in a CUDA graph; a
64-draft tree runs GDN's hybrid kernel or the other plugins' reference path, eagerly. Verify
costs grow with ``N**2`` per layer and drafting with ``D`` levels, for acceptance that rarely
passes 10 tokens per step (docs/DESIGN.md section 8)."""

MAX_NEW_TOKENS = 2**31 - 1
"""The largest ``max_new_tokens`` a run accepts: a 32-bit signed integer, so that every token
count and position derived from it fits the integer types of torch's and Triton's index
arithmetic. Even at 10,000 tokens/s a sequence this long takes 2.5 days; a larger value is a
typo (from ``2**63`` on, one overflows the int64 tensors of a step)."""


def validation_message(err, names: dict[str, str] | None = None, sources: dict[str, str] | None = None) -> str:
    """A pydantic ``ValidationError`` in one line: ``field: message; field: message``.

    Args:
        err: the error.
        names: what to call a field (its dotted location, e.g. ``engine.commit``) where the
            user set it by another name, e.g. a command-line flag; an item of a list field
            (``stop_token_ids.0``) takes its field's name.
        sources: where the user gave a top-level field (``engine``, ``top_p``) not in ``names``,
            written before its dotted location (``--config cfg.json engine.bogus``).
    """
    names, sources = names or {}, sources or {}

    def name(loc: tuple) -> str:
        dotted = ".".join(map(str, loc))
        field = next((names[k] for k in names if dotted == k or dotted.startswith(k + ".")), None)
        source = sources.get(str(loc[0])) if loc else None
        return field or (f"{source} {dotted}" if source else dotted) or "config"

    def message(e: dict) -> str:
        if e["type"] == "extra_forbidden":  # pydantic's "Extra inputs are not permitted"
            return "unknown option"
        return e["msg"].removeprefix("Value error, ")  # pydantic's prefix of what a validator raised

    return "; ".join(f"{name(e['loc'])}: {message(e)}" for e in err.errors())


class EngineOptions(BaseModel):
    """How the engine runs a :class:`SpecConfig`: the mode switches, apart from what is decoded.

    Fields:
        commit: how the accepted path reaches the recurrent state: ``factor`` (closed form from
            factor records, delayed into the next verify), or a baseline of
            :mod:`specla.baselines` where every mixer of the model declares it (else the adapter
            raises ``ConfigError``): ``snapshot`` (one state per node, pick the accepted one) or
            ``replay`` (re-run the accepted tokens from the pre-step state).
        kernels: ``auto`` (default: ``triton`` on a CUDA device, ``reference`` elsewhere),
            ``reference`` (batched PyTorch, every device and dtype) or ``triton`` (the plugin's
            Triton verify kernels with the fused delayed commit, where they apply: factor commit,
            float32 state, trees up to the kernel's size; elsewhere the reference path). On CPU
            the Triton kernels need ``TRITON_INTERPRET=1`` set before Python starts (Triton
            decides compiled or interpreted when a kernel is defined).
        verify_kernel: when the Triton kernels run: ``auto`` (the plugin's measured rule; for
            GDN: parallel up to 64 nodes, hybrid for more than 32 nodes at batch 1), or force
            ``serial``, ``parallel`` or ``hybrid``. CUDA graphs use ``serial`` for one-token passes
            (plain decoding) and ``parallel`` otherwise, whatever this says.
        cuda_graphs: ``auto`` (default): on a CUDA device, steps (greedy or sampled) run as recorded CUDA
            graphs (:mod:`specla.cuda.graph_step`; every step, the first after a prefill from an empty
            pending commit) when the plugin declares the
            ``cuda_graphs`` capability and the budget fits its recorded verify (``N <= 63`` with
            the Triton kernels), else eagerly; ``off``: always eager; ``on``: graphs or a
            ``ConfigError`` (also on a CPU, where no graph can be recorded); ``unrecorded``: the
            same fixed-shape step the graphs record, run without recording on any device (how a
            plugin's graph path is tested on a CPU; no faster than eager).
        budget_policy: ``adaptive``: each step runs the configured budget, for a tree
            (``top_k > 1``) also its chain (``top_k`` 1, ``num_draft_tokens`` = the tree's
            depth), or plain decoding (no drafts), whichever the measured step times and the
            drafter's recent acceptance make faster at the current batch size
            (:class:`specla.policy.BudgetPolicy`), so a run is never much slower than plain
            decoding; ``fixed``: every step drafts with the
            configured budget; ``auto`` (default): ``adaptive`` where the steps run in recorded
            CUDA graphs, ``fixed`` for eager steps and seeded sampling
            (:func:`specla.policy.resolve_budget_policy` says why, with the measurements).
            Greedy output is the same either way; sampled output follows the target's
            distribution either way, and a seeded run repeats exactly under ``fixed`` (under
            ``adaptive``, up to rare tokens decided by rounding: docs/usage.md, "Sampling").
        prefill: how prompts reach the state: ``chain`` (every plugin: the prompt as chains of
            64 tokens through the verify pass and a commit, recorded in CUDA graphs up to batch
            8), ``chunked`` (one pass over whole prompts where every mixer of the model has a
            whole-sequence path, ``Mixer.prefills_whole``: GDN, GLA and Mamba2 layers with the
            Triton kernels on a GPU, through FLA's ``chunk_gated_delta_rule``, ``chunk_gla`` and
            ``chunk_simple_gla``; KDA layers on a GPU through ``chunk_kda``; LFM2's convolution
            and attention layers, causal over the prompt, on any device; elsewhere ``chain``),
            ``passes`` (the prompt in passes of 256 tokens through those paths, each from the
            state the previous pass left, recorded in CUDA graphs up to batch 8 as the chain
            passes are: where every mixer's path continues from its state,
            ``Mixer.prefill_continues``, i.e. models without attention layers, such as FLA's GDN,
            GLA and Mamba2 models on a GPU; elsewhere ``chain``), ``auto`` (default): ``passes``
            where they run, the activations are bfloat16 or float16 and every mixer opts in
            (``Mixer.prefill_by_default``: GDN's), else ``chain`` (FLA's chunked kernels
            multiply float32 in TF32: a float32 run keeps the exact chain passes). On the
            trained ``small`` target in bfloat16 the passes took well under the chain passes'
            time and ``chunked`` well over it (docs/tuning.md, "Prefill forms").
            ``RunStats.prefill`` says which form ran (empty when every prompt is one token:
            nothing runs).
    Raises:
        pydantic.ValidationError: on an unknown field or a value outside its choices.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    commit: CommitStrategy = "factor"
    kernels: Literal["auto", "reference", "triton"] = "auto"
    verify_kernel: Literal["auto", "serial", "parallel", "hybrid"] = "auto"
    cuda_graphs: Literal["auto", "on", "off", "unrecorded"] = "auto"
    budget_policy: Literal["auto", "adaptive", "fixed"] = "auto"
    prefill: Literal["auto", "passes", "chunked", "chain"] = "auto"


def _outside_frame() -> int:
    """The ``stacklevel`` of the first caller outside specla and pydantic, so that a warning
    names the user's line (and Python's default filters, which show a ``DeprecationWarning``
    only where ``__main__`` triggers it, judge that line)."""
    inside = (str(Path(__file__).parent), str(Path(pydantic.__file__).parent))
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(inside):
        frame, level = frame.f_back, level + 1
    return level


def nest_engine_options(data: dict) -> dict:
    """``SpecConfig`` fields with the flat engine keys of earlier releases (``kernels="triton"``)
    moved into ``engine``, each with a ``DeprecationWarning`` naming its new spelling; ``data``
    itself (a dict of field name to value) is left as it is.

    Raises:
        ValueError: flat engine keys together with ``engine``.
    """
    flat = [k for k in EngineOptions.model_fields if k in data]
    if not flat:
        return data
    if "engine" in data:
        raise ValueError(f"{', '.join(flat)} given both flat and with engine: give the engine options "
                         f"in engine only (engine={{{flat[0]!r}: ...}})")
    for k in flat:
        choices = get_args(EngineOptions.model_fields[k].annotation)
        # a value outside the choices is refused under engine too: the new spelling names the choices
        spelling = (f"engine={{{k!r}: {data[k]!r}}}" if data[k] in choices else
                    f"engine={{{k!r}: X}} with X one of {', '.join(map(repr, choices))} ({data[k]!r} is none of them)")
        warnings.warn(f"SpecConfig field {k!r} is deprecated and will be removed in the next release: use {spelling}",
                      ConfigDeprecationWarning, stacklevel=_outside_frame())
    return {**{k: v for k, v in data.items() if k not in flat}, "engine": {k: data[k] for k in flat}}


class SpecConfig(BaseModel):
    """Options of one speculative-decoding run.

    Fields:
        num_draft_tokens: draft budget ``N``, the most draft nodes verified per step per sequence
            (the root, i.e. the last committed token, is not counted). ``0`` is plain
            autoregressive decoding through the same engine. At most
            :data:`MAX_DRAFT_TOKENS` (64); up to 63 fit the kernels' one-tile verify and CUDA
            graphs.
        max_depth: ``D``, the most draft tokens on one root-to-leaf path (so at most ``D`` tokens
            are accepted per step, plus the bonus token); a depth beyond ``N`` cannot be filled
            and acts as ``N``. At most :data:`MAX_DRAFT_TOKENS`.
        top_k: the most children per draft node; ``1`` gives chains.
        tau_tree: confidence-pruning margin in nats (SpecLA section 6.3): drafters that score
            nodes keep a node only if its path log-probability is within ``tau_tree`` of the best
            one; ``inf`` disables pruning.
        temperature: ``0`` is greedy decoding (token-identical to greedy autoregressive
            decoding); above ``0`` tokens are sampled from ``softmax(logits / temperature)``,
            losslessly: speculative output follows the target's distribution exactly
            (:func:`specla.acceptance.accept_sampling`; eager steps use a sampling drafter's
            ``q``, CUDA graphs verify every tree as deterministic proposals, which is lossless
            too but accepts less from a drafter that samples its tree).
        sampling_top_k: with sampling, keep only the most likely ``k`` tokens (``0``: all).
        top_p: with sampling, keep the smallest set of most likely tokens whose mass reaches it.
            Either one set with ``temperature == 0`` is refused (greedy decoding ignores them).
        seed: with sampling, seeds the run's generator so that it repeats exactly (``None``: a
            fresh random seed); ``0 <= seed < 2**64`` (what ``torch.Generator.manual_seed`` takes).
        max_new_tokens: generated tokens per prompt, bonus tokens included; at most
            :data:`MAX_NEW_TOKENS` (``2**31 - 1``).
        stop_token_ids: generation of a sequence ends after it emits one of these (kept in the
            output).
        stop_at_eos: also stop at the model's ``eos_token_id`` (as ``generate`` does).
        dtype: activation/weight dtype the target runs in, by name or as a ``torch.dtype``
            (stored by name); ``None`` keeps the model's (except that bfloat16/float16 models
            run in float32 on the CPU). Recurrent states and gates
            stay float32 (float64 when activations are float64).
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``...; ``None`` keeps the model's device. A CUDA
            device is rejected when torch sees no GPU.
        engine: how the engine runs (:class:`EngineOptions`): kernels, CUDA graphs, budget
            policy, prefill and commit forms. The old flat keys (``kernels="triton"``) are still
            accepted, with a ``DeprecationWarning``, and moved into ``engine``.
    Raises:
        pydantic.ValidationError: on any out-of-range or unknown field, an integer field given
            another type (``True``, ``"8"``, ``8.0``), a float field a bool or a string
            (``tau_tree``'s ``"inf"`` aside), sampling filters without sampling, or an
            engine option given both flat and in ``engine``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_draft_tokens: StrictInt = Field(8, ge=0, le=MAX_DRAFT_TOKENS)
    max_depth: StrictInt = Field(8, ge=1, le=MAX_DRAFT_TOKENS)
    top_k: StrictInt = Field(1, ge=1, le=64)
    tau_tree: float = Field(math.inf, ge=0.0)
    temperature: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    sampling_top_k: StrictInt = Field(0, ge=0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: StrictInt | None = Field(None, ge=0, lt=2**64)
    max_new_tokens: StrictInt = Field(64, ge=1, le=MAX_NEW_TOKENS)
    stop_token_ids: tuple[StrictInt, ...] = ()
    stop_at_eos: bool = True
    dtype: DType | None = None
    device: str | None = None
    engine: EngineOptions = EngineOptions()

    def with_engine(self, **options) -> "SpecConfig":
        """This config with the given :class:`EngineOptions` fields replaced.

        Raises:
            pydantic.ValidationError: an unknown option or a value outside its choices.
        """
        return self.model_copy(update={"engine": EngineOptions(**{**self.engine.model_dump(), **options})})

    @model_validator(mode="before")
    @classmethod
    def _flat_engine_options(cls, data):
        return nest_engine_options(data) if isinstance(data, dict) else data

    @field_serializer("tau_tree", when_used="json")
    def _finite_json(self, value: float) -> float | str:
        # strict JSON has no Infinity; "inf" reads back through validation
        return "inf" if math.isinf(value) else value

    @field_validator(*_INTEGER_FIELDS, mode="before")
    @classmethod
    def _integers(cls, value):
        return _as_int(value)

    @field_validator("temperature", "top_p", "tau_tree", mode="before")
    @classmethod
    def _numbers(cls, value):
        # pydantic's lax mode would read True as 1.0 and "0.8" as 0.8; tau_tree's "inf" is how
        # its JSON form writes infinity
        if isinstance(value, bool) or (isinstance(value, str) and value != "inf"):
            raise ValueError(f"must be a number, got {type(value).__name__} {value!r}")
        return value

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _integer_ids(cls, value):
        return tuple(_as_int(v) for v in value) if isinstance(value, (list, tuple)) else value

    @model_validator(mode="after")
    def _sampling_filters_need_sampling(self) -> "SpecConfig":
        # greedy decoding would ignore them silently (the CLI refuses its flags the same way)
        if self.temperature == 0 and (self.top_p != 1.0 or self.sampling_top_k != 0):
            raise ValueError(f"top_p ({self.top_p}) and sampling_top_k ({self.sampling_top_k}) filter sampling: "
                             "greedy decoding (temperature 0) would ignore them; set temperature > 0 or leave them "
                             "at 1.0 and 0")
        return self

    @field_validator("stop_token_ids")
    @classmethod
    def _non_negative_stops(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if any(t < 0 for t in value):
            raise ValueError(f"stop_token_ids must be non-negative token ids, got {value}")
        return value

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype_by_name(cls, value):
        import torch

        return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else value

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str | None) -> str | None:
        if value is None:
            return value
        import torch

        try:
            device = torch.device(value)
        except (RuntimeError, TypeError) as err:
            raise ValueError(f"device {value!r} is not a torch device (cpu, cuda, cuda:N)") from err
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"device {value!r}: specla runs on cpu or cuda")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {value!r} requested but torch sees no CUDA GPU")
        return value
