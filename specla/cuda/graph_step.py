"""CUDA-graph execution of the speculative step (docs/architecture.md, "CUDA graphs"; the speed it
is for: docs/DESIGN.md section 8, BENCHMARKS.md section 5).

Eager decoding of a linear-attention model is launch-bound: hundreds of small kernels per step,
each costing more host time than GPU time. :class:`GraphRunner` records one whole step (the
drafter's tree when it is built on the device, verify with the fused delayed commit, greedy
acceptance, the commit bookkeeping and the drafter's update) as one CUDA graph per batch size, and
replays it with a single host synchronisation per step: reading the step's outcome.

How the step stays capturable:

- every tensor a step reads and replaces lives in static buffers owned by the graph
  (``ModelAdapter.graph_state`` / ``Drafter.graph_state``); the recorded step ends by copying
  its new state into them, so each replay starts where the previous one ended;
- shapes are fixed per graph: trees are padded to the budget ``N`` (unused nodes are padding
  that acceptance never follows), acceptance paths to ``D + 1``; the adapter picks its kernel
  without reading the tree (``ModelAdapter.static_shapes``); nothing is read on the host;
- the batch is fixed per graph and rounded up to a power of two: sequences that finish stay in
  the batch as dead rows until at most half the rows are alive, then the live ones are gathered
  into the next smaller graph (so at most ``log2(B) + 1`` graphs exist per budget and are reused
  from one ``generate`` call to the next);
- a host-side drafter (n-gram) proposes on the CPU before each replay; its tree is copied into
  the graph's static tree buffers.

The step's depth limit (no drafts past ``max_new_tokens``) is left to the host: a graph verifies
full trees and the engine keeps only the tokens a sequence still has room for, which gives the
same output (every accepted token is the target's greedy token).

Sampling (``temperature > 0``) runs in the graph too: trees are verified as deterministic
proposals (greedy device trees, host trees without their ``q``), so acceptance is one draw per
depth and a walk (:func:`specla.acceptance.accept_sampling`), lossless whatever the drafter; the
engine copies the draws, keyed by output position (:func:`specla.acceptance.keyed_uniforms`), into
a static buffer before each replay.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..config import SpecConfig
from ..interfaces import Drafter, TargetAdapter
from ..model.adapter import ModelAdapter
from ..step import host_proposal, read_outcome, speculative_step, step_depth
from ..tree import DraftTree
from .capture import copy_into, record_graph, static_like, whole_rows


def batch_bucket(n: int) -> int:
    """The graph batch that holds ``n >= 1`` sequences: the next power of two."""
    return 1 << (n - 1).bit_length()


@dataclass
class _Graph:
    """One recorded step for a batch of ``B`` rows."""

    state: list[Tensor]  # static copies of adapter.graph_state()
    drafter_state: list[Tensor]  # static copies of drafter.graph_state()
    tree: tuple[Tensor, Tensor, Tensor] | None  # static host-drafter tree (tokens, parents, num_nodes)
    outcome: Tensor  # [B, 3 + D] int64: num_accepted, bonus, non-finite logits (0 / 1), accepted tokens
    uniforms: Tensor | None = None  # [B, D + 1] float32 draws by depth of a sampling step, filled before each replay
    graph: torch.cuda.CUDAGraph | None = None
    host: Tensor | None = None  # [2 B N + B] int64 pinned staging of the host tree, reused every step


class GraphRunner:
    """Runs greedy speculative steps as CUDA graphs (see the module docstring).

    Args:
        adapter: the target: a :class:`specla.model.adapter.ModelAdapter` (graph state, static
            shapes, the empty commit).
        drafter: the drafter; proposes on the device (``propose_on_device``) or on the host.
        config: the run's options; ``num_draft_tokens`` must be at most
            ``adapter.graph_max_nodes()``.
        capture: record CUDA graphs (``False`` runs the same static-buffer step eagerly, which is
            how the CPU tests check the runner's logic).

    Raises:
        ValueError: the adapter cannot run in graphs, or the budget is over its limit.
    """

    def __init__(self, adapter: ModelAdapter, drafter: Drafter, config: SpecConfig, capture: bool = True):
        problem = graph_problem(adapter, config)
        if problem:
            raise ValueError(f"CUDA graphs cannot run this configuration: {problem}")
        self.adapter, self.drafter, self.config, self.capture = adapter, drafter, config, capture
        self.depth = step_depth(config)
        self.graphs: dict[int, _Graph] = {}
        self.recorded = 0  # graphs recorded so far (RunStats.graphs_recorded)
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        # trees come from the host only for a host drafter with a budget (N = 0: an empty tree)
        self._host_drafts = not drafter.device_proposals and config.num_draft_tokens > 0
        self._bound: _Graph | None = None  # the graph whose static buffers hold the live state
        self._bound_roots: Tensor | None = None  # adapter.roots while bound (replaced by any prefill or select)
        self.sampling = config.temperature > 0

    # ------------------------------------------------------------------ the recorded step
    def _body(self, tree: DraftTree | None, uniforms: Tensor | None = None) -> Tensor:
        """:func:`specla.step.speculative_step` on the bound state, with fixed shapes; ``tree``
        ``None``: the drafter builds it on the device; ``uniforms`` ``[B, D + 1]``: a sampling
        step's draws by depth (the drafts count as deterministic proposals). Returns the outcome rows
        ``[B, 3 + D]``."""
        ad, dr, cfg = self.adapter, self.drafter, self.config
        ad.static_shapes = True
        try:
            if tree is None and cfg.num_draft_tokens == 0:
                tree = DraftTree.empty(ad.batch_size, ad.device)
            elif tree is None:
                tree = dr.propose_on_device(ad.roots, cfg)
            return speculative_step(ad, dr, tree, cfg, uniforms=uniforms)
        finally:
            ad.static_shapes = False

    def _record(self, g: _Graph) -> None:
        """One step on ``g``'s static buffers, ending with its new state copied back into them:
        what the CUDA graph holds."""
        ad, dr = self.adapter, self.drafter
        ad.set_graph_state(g.state)
        dr.set_graph_state(g.drafter_state)
        outcome = self._body(None if g.tree is None else DraftTree.trusted(*g.tree), g.uniforms)
        new = ad.graph_state() + dr.graph_state()
        if not (ad.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            # the warm-up before a capture (or an eager step): a static buffer takes the layout
            # the step writes (a column slice of a projection where the empty record was dense)
            static = [s if t is s or t.stride() == s.stride() or whole_rows(t) is None else static_like(t)
                      for s, t in zip(g.state + g.drafter_state, new)]
            g.state, g.drafter_state = static[: len(g.state)], static[len(g.state) :]
        copy_into(g.state + g.drafter_state, new)
        ad.set_graph_state(g.state)
        dr.set_graph_state(g.drafter_state)
        g.outcome.copy_(outcome)

    def _new_graph(self, B: int, state: list[Tensor], drafter_state: list[Tensor]) -> _Graph:
        """Static buffers for batch ``B`` (filled from the live state), recorded into a CUDA graph
        after a warm-up step on them (Triton compiles, cuBLAS picks its workspaces); the warm-up's
        effect on the buffers is then undone by reloading the live state."""
        dev = self.adapter.device
        tree = None
        if self._host_drafts:
            N = self.config.num_draft_tokens
            tree = (torch.zeros(B, N, dtype=torch.int64, device=dev),
                    torch.full((B, N), -1, dtype=torch.int64, device=dev),
                    torch.zeros(B, dtype=torch.int64, device=dev))
        g = _Graph([static_like(t) for t in state], [static_like(t) for t in drafter_state], tree,
                   torch.zeros(B, 3 + self.depth, dtype=torch.int64, device=dev))
        if self.sampling:
            g.uniforms = torch.rand(B, self.depth + 1, device=dev)  # overwritten before each step
        if tree is not None:  # the host tree's staging, once per graph: a pinned allocation synchronises
            g.host = self._staging(B, pinned=self.capture)
        if self.capture:
            g.graph = record_graph(lambda: self._record(g), dev, self.pool)
            self.recorded += 1
            self._load(g, state, drafter_state)
        return g

    @staticmethod
    def _load(g: _Graph, state: list[Tensor], drafter_state: list[Tensor]) -> None:
        copy_into(g.state + g.drafter_state, state + drafter_state)

    # ------------------------------------------------------------------ public
    def step(self, contexts: list[list[int]], uniforms: Tensor | None = None
             ) -> tuple[list[int], list[list[int]], list[int], list[bool]]:
        """One speculative step of the whole (physical) batch: one replay of the batch size's
        graph, recorded on first use. The first step after a prefill starts from a pending
        commit of nothing (:meth:`ModelAdapter.empty_commit`), so every step, the first
        included, is recorded or replayed. While the live state is the graph's own buffers (see
        :meth:`release`) nothing is copied or checked before the replay.

        Args:
            contexts: per row of the adapter's batch, the tokens so far (what a host drafter
                reads; dead rows may show any valid context).
            uniforms: a sampling step's draws by depth, ``[B, >= D + 1]`` float32 (on any device;
                :func:`specla.acceptance.keyed_uniforms`); required when sampling, unused otherwise.
        Returns:
            ``(num_accepted, accepted draft tokens, bonus, nonfinite)`` per row, on the host
            (:func:`specla.step.read_outcome`).
        Raises:
            BudgetError / InvalidTokenError / InvalidTreeError / ValueError: a host drafter's
                tree is invalid (checked on the CPU before anything runs).
            ValueError: a sampling step without ``uniforms`` of that shape.
        """
        ad, dr = self.adapter, self.drafter
        if self.sampling and (uniforms is None or uniforms.dim() != 2 or uniforms.shape[0] != ad.batch_size
                              or uniforms.shape[1] <= self.depth):
            got = None if uniforms is None else list(uniforms.shape)
            raise ValueError(f"a sampling step needs uniforms [{ad.batch_size}, >= {self.depth + 1}], got {got}")
        g = self._bound
        # a prefill or select outside the runner replaces the roots: that also unbinds
        if g is None or ad.roots is not self._bound_roots or self.graphs.get(ad.batch_size) is not g:
            ad.empty_commit(self.config.num_draft_tokens, self.depth)  # nothing pending after a prefill
            state, dstate = ad.graph_state(), dr.graph_state()
            B = ad.batch_size
            g = self.graphs.get(B)
            if g is not None and any(a.shape != b.shape for a, b in zip(g.state + g.drafter_state, state + dstate)):
                g = None  # a state sized per batch changed (the EAGLE cache follows the prompt length)
            if g is None:
                g = self.graphs[B] = self._new_graph(B, state, dstate)
            else:
                self._load(g, state, dstate)
            ad.set_graph_state(g.state)
            dr.set_graph_state(g.drafter_state)
            self._bound, self._bound_roots = g, ad.roots
        if g.tree is not None:
            for static, host in zip(g.tree, self._host_tree(contexts, g.host)):
                static.copy_(host, non_blocking=True)
        if g.uniforms is not None:
            g.uniforms.copy_(uniforms[:, : self.depth + 1], non_blocking=True)
        if g.graph is not None:
            g.graph.replay()
        else:
            self._record(g)
        return read_outcome(g.outcome)  # the step's one host synchronisation

    def release(self) -> None:
        """Forget which graph holds the live state: the next :meth:`step` reads the adapter's and
        drafter's state again. Call it whenever they were changed outside the runner; the engine
        does after a prefill or a gather (those also replace ``adapter.roots``, which the runner
        checks as well)."""
        self._bound = self._bound_roots = None

    def _host_tree(self, contexts: list[list[int]], buf: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The host drafter's trees, checked on the CPU and padded to the budget ``N``:
        ``(tokens [B, N], parents [B, N], num_nodes [B])`` int64 CPU tensors, views of ``buf``
        (a graph's staging, pinned when recorded, so the copy to the device is queued without
        waiting; the previous step's copy has finished, as each step synchronises).

        Raises:
            BudgetError / InvalidTokenError / InvalidTreeError: the drafter's tree is invalid.
        """
        cfg, B, N = self.config, len(contexts), self.config.num_draft_tokens
        tokens, parents, num = buf[: B * N].view(B, N), buf[B * N : 2 * B * N].view(B, N), buf[2 * B * N :]
        tokens.zero_()
        parents.fill_(-1)
        num.zero_()
        if N:
            tree = host_proposal(self.drafter, contexts, cfg, vocab_size=self.adapter.vocab_size)
            n = int(tree.num_nodes.max()) if B else 0  # columns past the widest real row are padding
            tokens[:, :n], parents[:, :n], num[:] = tree.tokens[:, :n], tree.parents[:, :n], tree.num_nodes
        return tokens, parents, num

    def _staging(self, B: int, pinned: bool) -> Tensor:
        """``[2 B N + B]`` int64 host buffer for one batch of host trees (tokens, parents,
        num_nodes)."""
        N = self.config.num_draft_tokens
        return torch.empty(2 * B * N + B, dtype=torch.int64, pin_memory=pinned)


def graph_problem(adapter: TargetAdapter, config: SpecConfig) -> str | None:
    """Why :class:`GraphRunner` cannot run ``config`` on ``adapter`` (``None``: it can): an
    adapter other than specla's :class:`~specla.model.adapter.ModelAdapter` has no graph state."""
    if not isinstance(adapter, ModelAdapter):
        return f"{type(adapter).__name__} has no graph state"
    if problem := adapter.graph_problem():
        return problem
    if config.num_draft_tokens > adapter.graph_max_nodes():
        return (f"num_draft_tokens={config.num_draft_tokens} is over the {adapter.graph_max_nodes()} draft nodes "
                "a recorded verify holds")
    return None
