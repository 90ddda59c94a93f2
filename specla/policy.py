"""Each step's draft budget, chosen from measured step costs and acceptance.

Speculation pays only while the tokens a step commits outweigh what the step costs over a plain
step; at large batches a verify pass turns compute-bound and the speculative step can lose to
plain decoding (vLLM and SGLang both fall below it there). :class:`BudgetPolicy` keeps the run at
least as fast as plain decoding: per batch size it measures the step time of the configured
budget and of plain decoding (no drafts), tracks the drafter's recent acceptance, and runs the
budget with the most tokens per second per sequence, re-measuring the others now and then.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import SpecConfig


def resolve_budget_policy(config: SpecConfig, recorded: bool) -> str:
    """What ``config.engine.budget_policy`` means for one engine: ``"adaptive"`` or ``"fixed"``.

    ``auto`` is ``adaptive`` where the steps are recorded in CUDA graphs, which is where it was
    measured (on the trained ``small`` target it stayed ahead of plain decoding at batches 1 to
    64, a little behind the fixed tree at batch 1 and ahead of it at batch 32; docs/tuning.md,
    "Budget policy"), and ``fixed`` elsewhere: eager steps (step times dominated by host
    overhead, which the policy was not measured on), no drafts at all, and seeded sampling. A
    sampled token is drawn by its output position whichever budget decides it
    (:func:`specla.acceptance.keyed_uniforms`), but a verify pass and a plain step round the
    logits differently, so a draw that falls within rounding of a boundary of the cumulative
    distribution can pick the neighbouring token: under a timing-driven schedule a seeded run
    would repeat only up to such rare tokens, and a seed promises an exact repeat.

    Args:
        config: the run's configuration.
        recorded: whether the steps run in recorded CUDA graphs.
    Returns:
        ``"adaptive"`` or ``"fixed"``.
    """
    if config.num_draft_tokens == 0:
        return "fixed"
    if config.engine.budget_policy != "auto":
        return config.engine.budget_policy
    seeded_sampling = config.temperature > 0 and config.seed is not None
    return "adaptive" if recorded and not seeded_sampling else "fixed"


@dataclass
class _Bucket:
    """What the policy knows about one batch size."""

    seconds: list[float | None]  # per candidate: moving average of a step's wall time (s)
    timed: list[int]  # per candidate: steps timed since the candidate was last (re)measured
    measured: list[int]  # per candidate: ``steps`` when its last measuring run began
    steps: int = 0  # steps observed at this batch size
    current: int = 0  # the candidate the last choice ran
    run_left: int = 0  # steps the current measuring run still has to go
    since_switch: int = 0  # steps since the current candidate took over
    since_probe: int = 0  # steps since the other candidates were last measured


class BudgetPolicy:
    """Chooses, per step and batch size, among candidate draft budgets: the engine passes the
    configured one first, for a tree its chain next, and plain decoding (no drafts) last.

    Rule: a candidate's rate is ``tokens / seconds``, its mean committed tokens per sequence-step
    (accepted drafts plus the bonus token: exactly 1 for plain decoding; a moving average over
    the steps that ran it, across batch sizes) over its mean step time at this batch size. Every
    candidate is first measured for ``warmup + window`` steps (the first ``warmup`` after a switch
    are not timed: a switch costs an eager step and, with CUDA graphs, may record one); then the
    fastest rate runs, and every ``reprobe`` steps one drafting candidate that is not running
    (the one measured longest ago) is measured again for ``warmup + window`` steps, since
    acceptance changes with the text (a running drafting candidate's acceptance is measured all
    along; plain decoding's step time moves little and is not re-measured). A batch size met
    next to one that was measured (half or twice it: rows finishing shrink the batch) first runs
    that one's choice, or its own fastest measured candidate once it beats it, and measures its
    other candidates one per ``reprobe`` steps: a short tail of a run is not spent measuring (each
    switch flushes the pending commit and moves the state into the other budget's graphs).

    Args:
        budgets: the draft budget ``N`` of each candidate, the configured one first (``0``:
            plain decoding).
        warmup, window, reprobe: step counts of the rule above.
        smoothing: weight of a new observation in the moving averages.
    Raises:
        ValueError: no candidate, or a count below 1 (``warmup`` below 0).
    """

    def __init__(self, budgets: list[int], *, warmup: int = 2, window: int = 4, reprobe: int = 256,
                 smoothing: float = 0.25):
        if not budgets or window < 1 or reprobe < 1 or warmup < 0 or not 0 < smoothing <= 1:
            raise ValueError(f"need budgets, window >= 1, reprobe >= 1, warmup >= 0, 0 < smoothing <= 1; got "
                             f"{budgets}, {window}, {reprobe}, {warmup}, {smoothing}")
        self.budgets = list(budgets)
        self.warmup, self.window, self.reprobe, self.smoothing = warmup, window, reprobe, smoothing
        # committed tokens per sequence-step, per candidate; plain decoding commits exactly one
        self.tokens: list[float | None] = [1.0 if b == 0 else None for b in self.budgets]
        self.buckets: dict[int, _Bucket] = {}

    def _bucket(self, batch: int) -> _Bucket:
        n = len(self.budgets)
        return self.buckets.setdefault(batch, _Bucket(seconds=[None] * n, timed=[0] * n, measured=[0] * n))

    def rate(self, batch: int, candidate: int) -> float | None:
        """Measured tokens per second per sequence of ``candidate`` at ``batch`` (``None``: not
        yet measured)."""
        s, tokens = self._bucket(batch), self.tokens[candidate]
        if s.seconds[candidate] is None or tokens is None or s.timed[candidate] < self.window:
            return None
        return tokens / max(s.seconds[candidate], 1e-9)  # a zero time (a coarse clock) is not a division error

    def choose(self, batch: int) -> int:
        """The candidate the next step at ``batch`` sequences runs."""
        s = self._bucket(batch)
        if s.run_left > 0:  # a measuring run goes on
            return self._run(s, s.current, measuring=False)
        n = len(self.budgets)
        unmeasured = [c for c in range(n) if self.rate(batch, c) is None]
        if unmeasured:
            prior = self._nearest_choice(batch)
            if prior is not None and s.since_probe < self.reprobe:
                known = [c for c in range(n) if c not in unmeasured]  # measured at this batch size
                if prior in known:
                    prior = max(known, key=lambda c: self.rate(batch, c))
                return self._run(s, prior, measuring=False)
            s.since_probe = 0
            return self._run(s, unmeasured[0], measuring=True)
        best = max(range(n), key=lambda c: self.rate(batch, c))
        drafting = [c for c in range(n) if c != best and self.budgets[c] > 0]
        if drafting and s.since_probe >= self.reprobe:  # their acceptance moves with the text
            s.since_probe = 0
            other = min(drafting, key=lambda c: s.measured[c])  # in turn: none is left unmeasured
            s.timed[other] = 0  # measured afresh
            return self._run(s, other, measuring=True)
        return self._run(s, best, measuring=False)

    def _nearest_choice(self, batch: int) -> int | None:
        """The fastest candidate at a batch size half or twice ``batch`` with every candidate
        measured (``None``: neither is)."""
        n = len(self.budgets)
        done = [b for b in self.buckets if b != batch and max(b, batch) <= 2 * min(b, batch)
                and all(self.rate(b, c) is not None for c in range(n))]
        if not done:
            return None
        near = min(done, key=lambda b: (max(b, batch) / min(b, batch), b))
        return max(range(n), key=lambda c: self.rate(near, c))

    def _run(self, s: _Bucket, candidate: int, measuring: bool) -> int:
        if candidate != s.current:
            s.current, s.since_switch = candidate, 0
        if measuring:
            s.run_left = self.warmup + self.window if s.since_switch == 0 else self.window
            s.measured[candidate] = s.steps
        return candidate

    def observe(self, batch: int, seconds: float | None, tokens: float) -> None:
        """The outcome of the step :meth:`choose` picked last at ``batch``: its wall time (s;
        ``None``: not representative, e.g. the first step after a prefill, which creates the
        pending commit eagerly) and the mean tokens it committed per live sequence."""
        s = self._bucket(batch)
        c, a = s.current, self.smoothing
        s.run_left = max(s.run_left - 1, 0)
        s.steps += 1
        s.since_switch += 1
        s.since_probe += 1
        if self.budgets[c] > 0:
            prev = self.tokens[c]
            self.tokens[c] = tokens if prev is None else (1 - a) * prev + a * tokens
        if seconds is not None and s.since_switch > self.warmup:
            prev = s.seconds[c]
            s.seconds[c] = seconds if prev is None or s.timed[c] == 0 else (1 - a) * prev + a * seconds
            s.timed[c] += 1
