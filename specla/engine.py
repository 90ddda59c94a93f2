"""The speculative decoding loop: prefill -> (draft -> verify -> accept -> commit)*; the last
commit stays pending until the state is read (see :meth:`Engine.generate`)."""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch

from .acceptance import keyed_uniforms
from .config import SpecConfig
from .errors import ConfigError, GenerationInterrupted, NonFiniteLogitsError, SpecError
from .cuda.graph_step import GraphRunner, batch_bucket, graph_problem
from .interfaces import Drafter, TargetAdapter
from .policy import BudgetPolicy, resolve_budget_policy
from .step import host_proposal, read_outcome, speculative_step, step_depth
from .tree import DraftTree


@dataclass
class RunStats:
    """Figures of one :meth:`Engine.generate` call.

    Attributes:
        steps: verify passes (one pass serves the whole batch).
        plain_steps: of those, the steps the budget policy ran without drafts
            (:mod:`specla.policy`).
        chain_steps: of those, the steps the budget policy ran the configured tree's chain
            (one child per node, as deep as the tree).
        budget_switches: times the budget policy changed the budget between two steps (with
            CUDA graphs each flushes the pending commit and moves the state to the other
            budget's graphs).
        switch_s: with CUDA graphs, wall-clock seconds of those switches: the flush and the
            first step after it.
        graphs_recorded: CUDA graphs of decoding steps recorded during the call (a batch size's
            graph is recorded once per budget and kept for later calls).
        sequence_steps: sum over steps of the sequences active in that step.
        generated_tokens: new tokens returned, all sequences.
        accepted_histogram: ``accepted_histogram[a]`` = sequence-steps that accepted ``a`` drafts.
        prefill: how the prompts reached the state (:attr:`TargetAdapter.prefill_form`: ``chain``,
            ``passes`` or ``chunked`` as the adapter ran them, e.g. ``chain`` where
            ``prefill="passes"`` has no kernels to run; empty where the adapter does not say).
        prefill_s, draft_s, verify_s, commit_s, wall_s: wall-clock seconds (CUDA synchronised);
            ``draft_s`` includes the host bookkeeping between steps. With CUDA graphs a step is
            one replay, and the whole decode (a host drafter's proposals included) counts as
            ``verify_s``; ``draft_s`` / ``commit_s`` stay 0.
        seed: a sampling run's seed, the configured one or the one drawn when none was given
            (``None`` for greedy runs): every draw is keyed by it, so passing it as
            ``SpecConfig.seed`` draws the same numbers again (a seeded run takes the fixed budget
            under ``budget_policy="auto"``, so a token within rounding of a draw's boundary may
            still differ from an adaptive run's).
    """

    steps: int = 0
    plain_steps: int = 0
    chain_steps: int = 0
    budget_switches: int = 0
    switch_s: float = 0.0
    graphs_recorded: int = 0
    sequence_steps: int = 0
    generated_tokens: int = 0
    accepted_histogram: list[int] = field(default_factory=list)
    prefill: str = ""
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    commit_s: float = 0.0
    wall_s: float = 0.0
    seed: int | None = None

    @property
    def mean_accepted_tokens(self) -> float:
        """Accepted draft tokens per sequence-step (the bonus token not counted)."""
        total = sum(a * n for a, n in enumerate(self.accepted_histogram))
        return total / max(self.sequence_steps, 1)

    @property
    def tokens_per_step(self) -> float:
        """Tokens committed per sequence-step: accepted drafts + 1 bonus (acceptance length)."""
        return self.mean_accepted_tokens + 1.0

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of wall time, prefill included."""
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict:
        """Every field and derived figure, JSON-ready."""
        out = asdict(self)
        out.update(
            mean_accepted_tokens=self.mean_accepted_tokens,
            tokens_per_step=self.tokens_per_step,
            tokens_per_s=self.tokens_per_s,
        )
        return out


class Engine:
    """Runs greedy speculative decoding of a batch with one adapter and one drafter.

    Args:
        adapter: the target, prepared by its plugin.
        drafter: proposes the draft trees.
        config: budget, stop conditions (``adapter.config`` is used for the tree checks).

    One engine holds one batch's state (the adapter's recurrent states, the drafter's caches, the
    recorded graphs), so :meth:`generate` calls from several threads are serialised: each waits
    for the one running and gets exactly the output it would get alone. For concurrent requests
    in one batch, pass them to one :meth:`generate` call.

    Raises:
        ConfigError: ``cuda_graphs="on"`` without a CUDA device, or ``"on"`` / ``"unrecorded"``
            for a configuration graphs cannot run.
    """

    def __init__(self, adapter: TargetAdapter, drafter: Drafter, config: SpecConfig):
        self.adapter, self.drafter, self.config = adapter, drafter, config
        # the budgets the steps choose from: the configured one; under the adaptive policy, for a
        # tree, its chain (top-1 children only, as deep as the tree: cheaper to draft and to
        # verify, which wins at large batches where verify is compute-bound); plain decoding last
        # why graphs cannot run here (None: they can), decided once
        self._graph_problem = graph_problem(adapter, config) if config.engine.cuda_graphs != "off" else None
        # steps recorded in CUDA graphs ("on" elsewhere, or with a problem, is refused below)
        self._recorded = (adapter.device.type == "cuda" and not self._graph_problem
                          and config.engine.cuda_graphs in ("auto", "on"))
        adaptive = resolve_budget_policy(config, self._recorded) == "adaptive"
        self.configs = [config]
        if adaptive and config.top_k > 1:
            depth = min(config.max_depth, config.num_draft_tokens)
            self.configs.append(config.model_copy(update={"num_draft_tokens": depth, "top_k": 1}))
        self.configs.append(config.model_copy(update={"num_draft_tokens": 0}))
        # each budget's graph runner, made on first use and kept across calls (its graphs are reused)
        self._graph_runners: list[GraphRunner | None] = [None] * len(self.configs)
        self.policy = BudgetPolicy([c.num_draft_tokens for c in self.configs]) if adaptive else None
        self._current = 0  # the candidate the last step ran
        self._forced: int | None = None  # a candidate every step runs, the policy aside (warm_up)
        self._lock = threading.Lock()  # one batch at a time: the state below is the engine's only copy
        # the thread holding _lock: a call from that same thread (its on_step callback) would wait
        # on itself forever, so it is refused instead
        self._owner: int | None = None
        # a sampling run's random source where the draws cannot be keyed by position (a drafter's
        # sampled tree with its q, on eager steps), and the seed of unseeded calls
        self._sampler = torch.Generator(device=adapter.device) if config.temperature > 0 else None
        if config.engine.cuda_graphs == "on" and adapter.device.type != "cuda":
            raise ConfigError(f"cuda_graphs='on' needs a CUDA device; the model runs on {adapter.device} "
                              "(cuda_graphs='unrecorded' runs the same fixed-shape step without recording)")
        if config.engine.cuda_graphs in ("on", "unrecorded") and self._graph_problem:
            raise ConfigError(f"cuda_graphs={config.engine.cuda_graphs!r}: {self._graph_problem}")
        if config.engine.cuda_graphs == "auto" and adapter.device.type == "cuda" and self._graph_problem:
            warnings.warn(f"CUDA graphs cannot run this configuration ({self._graph_problem}): every step runs "
                          "eagerly, several times slower on a GPU", stacklevel=3)

    def _clock(self) -> float:
        if self.adapter.device.type == "cuda":
            torch.cuda.synchronize(self.adapter.device)
        return time.perf_counter()

    def generate(self, prompts: list[list[int]],
                 on_step: Callable[[RunStats], None] | None = None) -> tuple[list[list[int]], RunStats]:
        """Decode every prompt until ``max_new_tokens`` or a stop token.

        Args:
            prompts: ``B`` non-empty lists of token ids.
            on_step: called after every step with the call's :class:`RunStats` so far (``steps``
                and ``generated_tokens`` are current; the times are filled in at the end), e.g.
                to show progress; ``None``: nothing is called.
        Returns:
            ``(outputs, stats)``: the new token ids per prompt (stop token included when hit).
        Raises:
            InvalidTokenError: empty prompt or id outside the vocabulary (nothing is run).
            InvalidTreeError / BudgetError: the drafter produced an invalid tree.
            NonFiniteLogitsError: the model's logits for a prompt at a step are NaN or +inf, or
                -inf for every token (the call's outputs are lost; the engine stays usable).
            SpecError: called from inside a running call on the same thread (from ``on_step``).
            GenerationInterrupted: a ``KeyboardInterrupt`` (Ctrl-C, or raised by ``on_step``)
                during the call, carrying the tokens generated until then; the next call runs
                as on a fresh engine (its prefill replaces the state).
        Thread-safe: concurrent calls run one after another (see the class docstring).
        Afterwards the adapter holds the state after the accepted tokens; with the ``factor``
        commit the last step's commit is still pending: ``adapter.recurrent_states()`` (and
        :meth:`TargetAdapter.flush`) apply it, the next call's prefill discards it.
        """
        with self._serialised():
            return self._generate(prompts, on_step)

    @contextmanager
    def _serialised(self) -> Iterator[None]:
        """Holds the engine for one call: other threads wait their turn; the thread already
        inside a call (its ``on_step`` calling back in) gets a SpecError, not a deadlock."""
        if self._owner == threading.get_ident():
            raise SpecError("generate was called from inside its own progress callback; the running call holds "
                            "the decoder until it returns: call generate again after it")
        with self._lock:
            self._owner = threading.get_ident()
            try:
                yield
            finally:
                self._owner = None

    def warm_up(self, prompts: list[list[int]]) -> None:
        """Decode ``prompts`` as a server does before it serves: under the adaptive policy, once
        with each candidate budget forced (the policy neither chooses nor observes those steps),
        so that every candidate's CUDA graph for this batch, and for the smaller graph batches
        its finishing rows gather into, is recorded now rather than inside a later call (the
        policy meets a candidate at a batch size first when it measures it, and recording a
        graph costs a whole call's worth of steps at large batch); then once as :meth:`generate`
        (the policy's first measurements). Outputs are dropped.

        Args:
            prompts: ``B`` non-empty lists of token ids.
        Raises:
            as :meth:`generate`.
        Thread-safe, as :meth:`generate`.
        """
        with self._serialised():
            if self.policy is not None:
                for c in range(len(self.configs)):
                    self._forced = c
                    try:
                        self._generate(prompts)
                    finally:
                        self._forced = None
            self._generate(prompts)

    def _generate(self, prompts: list[list[int]],
                  on_step: Callable[[RunStats], None] | None = None) -> tuple[list[list[int]], RunStats]:
        stats = RunStats(accepted_histogram=[0] * (step_depth(self.config) + 1))
        run = _Decoding(prompts, self.config, self.adapter.eos_token_ids, stats, on_step)
        start = self._clock()
        try:
            self._decode(run, start)
        except KeyboardInterrupt as interrupt:
            # what the steps before it accepted is kept; the state is left as the interrupt found
            # it, and the next call's prefill replaces it
            raise GenerationInterrupted(*self._finish(run, start)) from interrupt
        return self._finish(run, start)

    def _finish(self, run: _Decoding, start: float) -> tuple[list[list[int]], RunStats]:
        run.stats.wall_s = self._clock() - start
        run.stats.generated_tokens = sum(len(o) for o in run.outputs)
        return run.outputs, run.stats

    def _decode(self, run: _Decoding, start: float) -> None:
        """Prefill ``run``'s prompts, then decode them to the end."""
        cfg, adapter, stats, prompts = self.config, self.adapter, run.stats, run.prompts
        runner = self._graph_runner()
        adapter.prefill(prompts)
        stats.prefill = adapter.prefill_form
        self.drafter.reset(prompts)
        if self._sampler is not None:
            run.seed = stats.seed = cfg.seed if cfg.seed is not None else self._sampler.seed()
            self._sampler.manual_seed(run.seed)
        if runner is not None:
            for r in self._runners():
                r.release()  # the state was replaced: the next step loads it into its graph
        if runner is not None and batch_bucket(len(run.rows)) > len(run.rows):  # graphs run power-of-two batches
            self._gather(run, list(range(len(run.rows))), batch_bucket(len(run.rows)))
        t = self._clock()
        stats.prefill_s = t - start
        if runner is not None:
            self._decode_graphs(run)
            stats.verify_s = self._clock() - t  # one span: a step is one replay
        else:
            self._decode_eager(run, t)
        # the last step's commit stays pending: reading the state applies it (recurrent_states
        # flushes) and the next prefill discards it, so no call pays an eager commit it never uses

    def _decode_eager(self, run: _Decoding, t: float) -> None:
        """Eager steps until every sequence is done; finished rows leave the batch at once."""
        cfg, stats, generator = self.config, run.stats, self._sampler
        first = True  # the first step after a prefill or a gather is not timed for the policy
        while True:
            room = [cfg.max_new_tokens - len(run.outputs[s]) - 1 for s in run.shown]
            c = self._choose(len(run.rows))
            if c != self._current:
                self._current = c
                stats.budget_switches += 1
            num, drafted, bonus, nonfinite, (t1, t2, t3) = self._eager_step(run, room, generator, self.configs[c])
            run.check_logits(nonfinite)
            stats.draft_s += t1 - t
            stats.verify_s += t2 - t1
            stats.commit_s += t3 - t2
            self._observe(run, num, None if first else t3 - t, c)
            t, first = t3, False
            run.absorb(num, drafted, bonus)
            live = run.live()
            if not live:
                return
            if len(live) < len(run.rows):
                self._gather(run, live, len(live))
                first = True

    def _decode_graphs(self, run: _Decoding) -> None:
        """Recorded steps until every sequence is done. Finished rows stay as dead rows until at
        most half the batch is alive, then the live ones are gathered into a smaller graph."""
        first = True
        recorded = sum(r.recorded for r in self._runners())
        while True:
            c = self._choose(len(run.rows))
            switched = c != self._current
            t = time.perf_counter()
            if switched:  # the other budget's graphs hold other record shapes: start afresh
                self.adapter.flush()
                for r in self._runners():
                    r.release()
                self._current = c
                run.stats.budget_switches += 1
            runner = self._graph_runner(c)
            t_step = time.perf_counter()
            draws = run.uniforms(runner.depth + 1) if self._sampler is not None else None
            num, drafted, bonus, nonfinite = runner.step(run.row_contexts(), draws)  # synchronises
            done = time.perf_counter()
            run.check_logits(nonfinite)
            if switched:
                run.stats.switch_s += done - t
            self._observe(run, num, None if first else done - t_step, c)
            first = False
            run.absorb(num, drafted, bonus)
            live = run.live()
            if not live:
                run.stats.graphs_recorded = sum(r.recorded for r in self._runners()) - recorded
                return
            if len(live) <= len(run.rows) // 2:
                self._gather(run, live, batch_bucket(len(live)))
                for r in self._runners():
                    r.release()
                first = True

    def _choose(self, batch: int) -> int:
        """The candidate budget of the next step: an index into ``self.configs`` (0: the
        configured one; the last: plain decoding)."""
        if self._forced is not None:
            return self._forced
        return 0 if self.policy is None else self.policy.choose(batch_bucket(batch))

    def _observe(self, run: _Decoding, num: list[int], seconds: float | None, candidate: int) -> None:
        """Tell the policy how the step went: wall time and tokens per live sequence."""
        if candidate == len(self.configs) - 1:
            run.stats.plain_steps += 1
        elif candidate:
            run.stats.chain_steps += 1
        if self.policy is None or self._forced is not None:
            return
        live = [n for n, seq in zip(num, run.rows) if seq is not None]
        self.policy.observe(batch_bucket(len(run.rows)), seconds, 1 + sum(live) / max(len(live), 1))

    def _eager_step(self, run: _Decoding, room: list[int], generator: torch.Generator | None, budget: SpecConfig):
        """The host drafter's checked tree (the device drafters build theirs inside ``propose``),
        then :func:`specla.step.speculative_step`, op by op, with ``budget``'s draft budget and
        the run's sampling options (a sampled step draws by position, unless the drafter sampled
        its tree and gives its ``q``). ``room[r]``: drafts row ``r`` may still use (deeper nodes
        are cut). Returns ``(num_accepted, accepted tokens, bonus, nonfinite)`` per row (host
        lists) and the clock after drafting, verify+accept and commit."""
        adapter = self.adapter
        tree = host_proposal(self.drafter, run.row_contexts(), budget, vocab_size=adapter.vocab_size)
        # drafts past max_new_tokens would be verified for nothing: the bonus token is always emitted
        tree = tree.limit_depth(torch.tensor(room).clamp(min=0))
        tree = DraftTree.trusted(*(x.to(adapter.device) for x in (tree.tokens, tree.parents, tree.num_nodes)),
                                 draft_probs=None if tree.draft_probs is None else tree.draft_probs.to(adapter.device))
        draws = None
        if generator is not None and tree.draft_probs is None:
            draws = run.uniforms(step_depth(budget) + 1).to(adapter.device)
        marks = [self._clock()]
        rows = speculative_step(adapter, self.drafter, tree, budget, generator=generator, uniforms=draws,
                                after_accept=lambda: marks.append(self._clock()))
        marks.append(self._clock())
        return (*read_outcome(rows), tuple(marks))

    def _gather(self, run: _Decoding, keep: list[int], size: int) -> None:
        """Keep the adapter and drafter rows ``keep`` (in order), padded to ``size`` rows with
        copies of the first one (dead rows); updates ``run.rows`` and ``run.shown``."""
        index = keep + [keep[0]] * (size - len(keep))
        tensor = torch.tensor(index, dtype=torch.int64)
        self.adapter.select(tensor)
        self.drafter.select(tensor)
        run.rows[:] = [run.rows[i] for i in keep] + [None] * (size - len(keep))
        run.shown[:] = [run.shown[i] for i in index]

    def _graph_runner(self, candidate: int = 0) -> GraphRunner | None:
        """The CUDA-graph runner of a candidate budget (an index into ``self.configs``) when
        ``config.engine.cuda_graphs`` asks for graphs, else ``None`` (eager steps)."""
        if not (self._recorded or self.config.engine.cuda_graphs == "unrecorded"):
            return None
        if self._graph_runners[candidate] is None:
            runner = GraphRunner(self.adapter, self.drafter, self.configs[candidate], capture=self._recorded)
            self._graph_runners[candidate] = runner
        return self._graph_runners[candidate]

    @property
    def _runner(self) -> GraphRunner | None:
        """The configured budget's runner, once made."""
        return self._graph_runners[0]

    def _runners(self) -> list[GraphRunner]:
        """The runners made so far (they share the adapter's state)."""
        return [r for r in self._graph_runners if r is not None]


class _Decoding:
    """The host's bookkeeping of one ``generate`` call: outputs and contexts per prompt, and which
    prompt each row of the adapter's batch decodes (``rows[r]``: ``None`` for a finished row a
    CUDA graph keeps until the batch is gathered; ``shown[r]``: whose context row ``r`` shows), and
    the caller's ``on_step`` (:meth:`Engine.generate`), called after each step is absorbed."""

    def __init__(self, prompts: list[list[int]], cfg: SpecConfig, eos: tuple[int, ...], stats: RunStats,
                 on_step: Callable[[RunStats], None] | None = None):
        self.cfg, self.stats, self.prompts, self.on_step = cfg, stats, prompts, on_step
        self.contexts = [list(p) for p in prompts]
        self.outputs: list[list[int]] = [[] for _ in prompts]
        self.rows: list[int | None] = list(range(len(prompts)))
        self.shown = list(range(len(prompts)))
        self.seed = 0  # a sampling run's: what its draws are keyed by
        self.stops = set(cfg.stop_token_ids)
        if cfg.stop_at_eos:
            self.stops.update(eos)

    def row_contexts(self) -> list[list[int]]:
        return [self.contexts[s] for s in self.shown]

    def uniforms(self, width: int) -> torch.Tensor:
        """``[rows, width]`` float32 CPU draws of a sampling step: row ``r``'s column ``d`` keyed
        by the sequence it shows and the output position of its ``d``-th token this step
        (:func:`specla.acceptance.keyed_uniforms`)."""
        return keyed_uniforms(self.seed, self.shown, [len(self.outputs[s]) for s in self.shown], width)

    def live(self) -> list[int]:
        return [r for r, seq in enumerate(self.rows) if seq is not None]

    def check_logits(self, nonfinite: list[bool]) -> None:
        """Refuse a step whose tokens some live row chose from logits with no usable maximum
        (:func:`specla.step.nonfinite_rows`); dead rows are ignored.

        Raises:
            NonFiniteLogitsError: naming those rows' prompts and the step.
        """
        bad = [seq for seq, flag in zip(self.rows, nonfinite) if flag and seq is not None]
        if bad:
            raise NonFiniteLogitsError(
                f"prompt{'s' * (len(bad) > 1)} {', '.join(map(str, bad))}: the model's logits at decode step "
                f"{self.stats.steps + 1} hold NaN or +inf, or are -inf for every token: no token can be chosen "
                "from them")

    def absorb(self, num: list[int], drafted: list[list[int]], bonus: list[int]) -> None:
        """One step's outcome per row: append the accepted drafts and the bonus token, up to a stop
        token or ``max_new_tokens`` (a graph verifies past a row's room; the rest is dropped)."""
        cfg, stats = self.cfg, self.stats
        stats.steps += 1
        for row, seq in enumerate(self.rows):
            if seq is None:
                continue
            stats.sequence_steps += 1
            room = cfg.max_new_tokens - len(self.outputs[seq])
            stats.accepted_histogram[min(num[row], room - 1)] += 1
            for tok in drafted[row][: num[row]] + [bonus[row]]:
                self.outputs[seq].append(tok)
                self.contexts[seq].append(tok)
                if tok in self.stops or len(self.outputs[seq]) >= cfg.max_new_tokens:
                    self.rows[row] = None
                    break
        if self.on_step is not None:  # counted only for it: a step without one pays nothing
            stats.generated_tokens = sum(len(o) for o in self.outputs)
            self.on_step(stats)
