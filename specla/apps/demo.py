"""``specla demo``: the main job on the embedded default target, with a side-by-side
autoregressive baseline in the same run."""

from __future__ import annotations

import json
import sys
import time
from importlib import resources

import torch
from tqdm.auto import tqdm

from .. import registry
from ..api import SpecDecoder
from ..config import SpecConfig
from ..drafters import make_drafter
from ..errors import DrafterError, UnknownPluginError


def demo_prompts() -> list[dict]:
    """The bundled prompts (``specla/apps/data/demo_prompts.jsonl``): ``id``, ``category``, ``prompt``."""
    text = resources.files(__package__).joinpath("data/demo_prompts.jsonl").read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def default_checkpoint() -> tuple[str, object]:
    """``(plugin name, checkpoint dir)`` of the first registered plugin that ships a demo model,
    the built-in ones first (a third-party plugin does not replace the bundled demo).

    Raises:
        RuntimeError: no installed plugin ships one.
    """
    for info in sorted(registry.plugin_infos(), key=lambda p: not p.builtin):  # stable: by name within each
        path = registry.get_plugin(info.name).demo_checkpoint
        if path is not None:
            return info.name, path
    loaded = ", ".join(sorted(info.name for info in registry.plugin_infos())) or "none"
    raise RuntimeError("no installed plugin ships a demo checkpoint"
                       + registry.limited_loading(f"only {loaded} loaded"))


def shown_prompt(prompt: str, limit: int = 300) -> str:
    """What the demo prints of a prompt: all of it up to ``limit`` characters (trailing
    whitespace dropped), else its end from the first line start among the last ``limit``
    characters (a word start when that line start would leave less than half of them), after a
    ``[... N characters cut]`` line. The model always reads the whole prompt; only the echo is
    shortened.

    Args:
        prompt: the prompt text; limit: the most characters shown (> 0).
    Raises:
        ValueError: ``limit < 1``.
    """
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    text = prompt.rstrip()
    if len(text) <= limit:
        return text
    start = len(text) - limit
    line = text.find("\n", start - 1)  # a cut right before a line start keeps that whole line
    if line != -1 and line + 1 <= start + limit // 2:  # a line start, unless it would hide most of the end
        cut = line + 1
    else:  # a word start: after whitespace, or the hard limit when the end is one long word
        cut = next((i + 1 for i in range(start - 1, len(text) - 1) if text[i].isspace() and not text[i + 1].isspace()),
                   start)
    return f"[... {cut} characters cut]\n{text[cut:]}"


def _stdout_line(line: str) -> None:
    """One line to stdout, flushed, without tearing a progress bar drawn on stderr."""
    tqdm.write(line, file=sys.stdout)
    sys.stdout.flush()


def run_demo(device: str | None = None, max_new_tokens: int = 96, drafter: str = "ngram", echo=None,
             progress: bool = True) -> dict:
    """Decode the bundled prompts speculatively and autoregressively (batch 1, float32), print each
    generation, and return the summary figures.

    Args:
        device: ``cpu``/``cuda``; ``None`` picks CUDA when available.
        max_new_tokens: tokens per prompt.
        drafter: ``ngram`` (the default: on the tiny target it accepts more than the shipped
            EAGLE drafter, docs/targets.md), ``eagle`` (the drafter shipped with the demo
            target), or a drafter directory; a name is never read as a folder (a folder named
            ``ngram`` is ``./ngram``), as in :func:`specla.drafters.make_drafter`.
        echo: where lines go, one call per line (``None``: stdout, flushed at each line).
        progress: show a progress bar on stderr (loading, warm-up, then one update per prompt).
    Raises:
        UnknownPluginError: another drafter name, before the target is loaded.
        DrafterError: before the target is loaded, a path that is not a trained drafter
            directory or the name of another plugin's models' own drafter; once it is loaded, a
            drafter of its own (``mtp``) that its checkpoint does not ship (the message gives
            the reason).
    Returns:
        ``exact_match`` (speculative == autoregressive tokens for every prompt),
        ``mean_accepted_tokens`` (drafts accepted per step), ``tokens_per_s`` and
        ``ar_tokens_per_s`` (generated tokens over decode wall time, prefill included, batch 1),
        ``speedup`` (their ratio), ``device``, ``plugin``, ``prompts``.
    """
    echo = echo or _stdout_line
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    rows = demo_prompts()
    plugin, path = default_checkpoint()
    arch = registry.get_plugin(plugin)
    shipped, choices = arch.demo_drafters, ", ".join(["ngram", *sorted(arch.demo_drafters)])
    # the target's own drafter (mtp) is asked of the loaded target: only its checkpoint says whether it ships one
    own = drafter in arch.model_drafters and drafter not in shipped
    try:  # any other drafter before the target loads and the progress bar starts
        proposer = drafter if own else make_drafter(shipped.get(drafter, drafter))
    except UnknownPluginError:
        raise UnknownPluginError(f"unknown demo drafter {drafter!r}: use {choices} "
                                 "or a directory saved by `specla train-drafter`") from None
    bar = tqdm(total=len(rows), desc="demo: loading the target", unit="prompt", file=sys.stderr,
               disable=not progress, dynamic_ncols=True)
    cfg = SpecConfig(num_draft_tokens=8, max_depth=6, top_k=2, max_new_tokens=max_new_tokens,
                     dtype="float32", device=device)
    try:
        spec = SpecDecoder(path, plugin, drafter=proposer, config=cfg)
    except DrafterError as err:
        bar.close()
        if not own:
            raise
        raise DrafterError(f"the demo's target cannot run its own drafter {drafter!r} ({err}); the demo runs "
                           f"{choices} or a directory saved by `specla train-drafter`") from err
    ar = SpecDecoder(spec.model, plugin, config=cfg.model_copy(update={"num_draft_tokens": 0}),
                     tokenizer=spec.tokenizer)
    params = sum(p.numel() for p in spec.model.parameters())
    echo(f"target: the {plugin} plugin's demo model, {type(spec.model).__name__} with {params / 1e6:.0f}M parameters, "
         "trained for minutes on a small corpus: its text loops; what the demo shows is exact_match (speculative "
         "tokens equal plain decoding's) and the speedup, in the JSON line at the end")
    bar.set_description("demo: warm-up")
    spec.generate([rows[0]["prompt"]])  # warm-up: first-call allocations stay out of the timing
    ar.generate([rows[0]["prompt"]])
    bar.set_description("demo: decoding")
    totals = {"spec_s": 0.0, "ar_s": 0.0, "tokens": 0, "ar_tokens": 0, "accepted": 0, "steps": 0}
    exact = True
    for row in rows:
        bar.set_postfix_str(row["id"])
        t = time.perf_counter()
        s = spec.generate([row["prompt"]])
        totals["spec_s"] += time.perf_counter() - t
        t = time.perf_counter()
        a = ar.generate([row["prompt"]])
        totals["ar_s"] += time.perf_counter() - t
        exact &= s.outputs == a.outputs
        totals["tokens"] += s.stats.generated_tokens
        totals["ar_tokens"] += a.stats.generated_tokens
        totals["accepted"] += sum(k * n for k, n in enumerate(s.stats.accepted_histogram))
        totals["steps"] += s.stats.sequence_steps
        echo(f"=== {row['id']} ({row['category']}) " + "=" * 30)
        echo(shown_prompt(row["prompt"]))
        echo(f"--- generated ({s.stats.generated_tokens} tokens; per step {s.stats.mean_accepted_tokens:.2f} drafts "
             "accepted, plus the bonus token):")
        echo(s.texts[0])
        bar.update(1)
    bar.close()
    tps, ar_tps = totals["tokens"] / totals["spec_s"], totals["ar_tokens"] / totals["ar_s"]
    return {
        "exact_match": bool(exact),
        "mean_accepted_tokens": totals["accepted"] / max(totals["steps"], 1),
        "tokens_per_s": tps,
        "ar_tokens_per_s": ar_tps,
        "speedup": tps / ar_tps,
        "device": device,
        "plugin": plugin,
        "drafter": drafter,
        "prompts": len(rows),
    }
