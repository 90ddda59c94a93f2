"""The speculative step (docs/architecture.md, "The step"): verify -> accept -> commit -> drafter
update, one body for the engine's eager steps (:class:`specla.engine.Engine`) and the recorded
CUDA-graph step (:class:`specla.cuda.graph_step.GraphRunner`), and the checked proposals of host drafters
that both take.

The body reads nothing on the host: acceptance walks at most ``depth`` levels, and its outcome
comes back as one ``[B, 3 + depth]`` tensor (:func:`outcome_rows`) that the caller reads once
(:func:`read_outcome`), which is the step's only host synchronisation. That tensor also says which
rows chose their tokens from logits with no usable maximum (:func:`nonfinite_rows`), so the
check costs no synchronisation of its own.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .acceptance import accept_greedy, accept_sampling, node_uniforms, sampling_probs
from .config import SpecConfig
from .errors import InvalidTreeError
from .interfaces import Drafter, TargetAdapter
from .records import Acceptance
from .tree import DraftTree


def step_depth(config: SpecConfig) -> int:
    """``D``: the deepest draft a step of ``config``'s budget verifies (``min(max_depth,
    num_draft_tokens)``)."""
    return min(config.max_depth, config.num_draft_tokens)


def speculative_step(adapter: TargetAdapter, drafter: Drafter, tree: DraftTree, config: SpecConfig, *,
                     generator: torch.Generator | None = None, uniforms: Tensor | None = None,
                     after_accept: Callable[[], None] | None = None) -> Tensor:
    """Verify ``tree`` (the pending commit applied first), accept, commit the accepted path and
    update the drafter, with no host reads.

    Acceptance is greedy at ``temperature == 0``; otherwise lossless sampling
    (:func:`specla.acceptance.accept_sampling`): with ``uniforms`` the drafts count as
    deterministic proposals and each node samples with its depth's draw (keyed by output
    position, :func:`specla.acceptance.keyed_uniforms`: the tokens are those plain decoding
    samples with the same draws, up to rounding), else with the tree's ``draft_probs`` when it
    has them and draws from ``generator``.

    Args:
        adapter, drafter: the run's. tree: ``B`` trees on the adapter's device, already checked
            against ``config``'s budget and the vocabulary (:func:`host_proposal`, or the
            drafter's device builder).
        config: the step's budget and sampling options.
        generator: the eager sampling step's random source.
        uniforms: ``[B, >= D + 1]`` float32 draws from ``U[0, 1)`` on the adapter's device, column
            ``d`` for the token at depth ``d`` (the bonus token at the root: column 0).
        after_accept: called between acceptance and commit (the eager step's clock).
    Returns:
        ``[B, 3 + D]`` int64 on the device (:func:`outcome_rows`), ``D`` = :func:`step_depth`.
    """
    depth = step_depth(config)
    out = adapter._verify(tree)
    if config.temperature > 0:
        probs = sampling_probs(out.logits, config.temperature, config.sampling_top_k, config.top_p)
        if uniforms is not None:
            acceptance = accept_sampling(tree, probs, None, uniforms=node_uniforms(tree, uniforms), max_depth=depth)
        else:  # with the drafter's q when it gives one, else one-hot q: lossless either way
            q = tree.draft_probs
            acceptance = accept_sampling(tree, probs, q, generator, max_depth=depth if q is None else None)
    else:
        acceptance = accept_greedy(tree, out.logits, max_depth=depth,
                                   kernels=bool(getattr(adapter, "triton_kernels", False)))
    if after_accept is not None:
        after_accept()
    adapter._commit(tree, out, acceptance)
    drafter.on_commit(acceptance, out)
    return outcome_rows(acceptance, depth, nonfinite_rows(out.logits, acceptance.path))


def nonfinite_rows(logits: Tensor, path: Tensor) -> Tensor:
    """Which rows chose this step's tokens from logits with no usable maximum: at a node of the
    accepted path (the root included; the bonus token comes from the last one), a NaN or ``+inf``,
    or ``-inf`` for every token. ``-inf`` for some tokens (masked ones) is fine. No host read: the
    recorded step computes it too.

    Args:
        logits: ``[B, N + 1, vocab]`` the verify logits. path: ``[B, D + 1]`` the accepted nodes,
            root-explicit, ``-1`` padded (:class:`~specla.records.Acceptance`).
    Returns:
        ``[B]`` bool.
    """
    peak = logits.amax(-1)  # NaN where an entry is NaN, +inf where one is +inf, -inf where all are
    return (~torch.isfinite(peak.gather(1, path.clamp(min=0))) & (path >= 0)).any(-1)


def outcome_rows(acceptance: Acceptance, depth: int, nonfinite: Tensor) -> Tensor:
    """One step's outcome as ``[B, 3 + depth]`` int64 rows: ``num_accepted``, the bonus token,
    ``nonfinite`` (``[B]`` bool, :func:`nonfinite_rows`) as 0 / 1, then the accepted draft tokens,
    padded with ``-1``."""
    tokens = acceptance.tokens
    pad = torch.full((tokens.shape[0], depth - tokens.shape[1]), -1, dtype=torch.int64, device=tokens.device)
    return torch.cat([acceptance.num_accepted[:, None], acceptance.bonus[:, None], nonfinite[:, None].long(),
                      tokens, pad], 1)


def read_outcome(rows: Tensor) -> tuple[list[int], list[list[int]], list[int], list[bool]]:
    """:func:`outcome_rows` on the host (the step's one synchronisation): ``(num_accepted,
    accepted draft tokens (padded), bonus, nonfinite)`` per row."""
    rows = rows.tolist()
    return [r[0] for r in rows], [r[3:] for r in rows], [r[1] for r in rows], [bool(r[2]) for r in rows]


def host_proposal(drafter: Drafter, contexts: list[list[int]], config: SpecConfig, *, vocab_size: int) -> DraftTree:
    """``drafter.propose`` on the host, checked: ``None`` reads as "no drafts" (an empty tree),
    and the tree is rebuilt through :class:`DraftTree`'s construction checks (topological order,
    canonical padding) and validated against the budget and the vocabulary. Both the eager and
    the CUDA-graph step take their host trees from here, so they accept and reject the same trees
    (a drafter may return :meth:`DraftTree.trusted` trees, which skip the construction checks).

    Args:
        drafter: a host drafter. contexts: per row, the tokens so far. config: the budget.
        vocab_size: the target's vocabulary size.
    Returns:
        a CPU :class:`DraftTree` with ``len(contexts)`` rows, padding canonical (token 0, parent -1).
    Raises:
        TypeError: the drafter returned something other than a ``DraftTree`` or ``None``.
        InvalidTreeError: a parent at or after its child, wrong shapes or dtypes, or a batch
            size other than ``len(contexts)``.
        BudgetError: more than ``num_draft_tokens`` nodes or a path deeper than ``max_depth``.
        InvalidTokenError: a real node's token outside ``0..vocab_size-1``.
    """
    tree = drafter.propose(contexts, config) if config.num_draft_tokens else None
    if tree is None:
        return DraftTree.empty(len(contexts))
    if not isinstance(tree, DraftTree):
        raise TypeError(f"drafter {drafter.name!r} returned {type(tree).__name__}, not a DraftTree")
    tree = DraftTree(*(x.cpu() for x in (tree.tokens, tree.parents, tree.num_nodes)), draft_probs=tree.draft_probs)
    if tree.batch_size != len(contexts):
        raise InvalidTreeError(f"drafter {drafter.name!r} proposed {tree.batch_size} trees for "
                               f"{len(contexts)} sequences")
    n = int(tree.num_nodes.max()) if tree.batch_size else 0
    if tree.width > n:  # columns past the widest real row are padding: neither checks nor verify see them
        q = tree.draft_probs
        tree = DraftTree.trusted(tree.tokens[:, :n], tree.parents[:, :n], tree.num_nodes,
                                 None if q is None else q[:, :n])
    tree.validate(vocab_size=vocab_size, max_nodes=config.num_draft_tokens, max_depth=config.max_depth)
    if tree.draft_probs is not None:
        _check_draft_probs(tree, vocab_size)
    return tree


def _check_draft_probs(tree: DraftTree, vocab_size: int) -> None:
    """A sampling drafter's ``q`` must be what lossless acceptance assumes: per real node a
    distribution over the target's vocabulary (finite, non-negative, summing to 1 within 1e-3)
    that gives the node's own token positive probability.

    Raises:
        InvalidTreeError: naming the first offending sequence and node.
    """
    q = tree.draft_probs
    if q.shape[-1] != vocab_size:
        raise InvalidTreeError(f"draft_probs has {q.shape[-1]} columns; the target's vocabulary has {vocab_size}")
    valid = tree.valid.to(q.device)
    rows = q.float()
    own = rows.gather(-1, tree.tokens.to(q.device)[..., None]).squeeze(-1)
    bad = valid & (~torch.isfinite(rows).all(-1) | (rows < 0).any(-1) | ((rows.sum(-1) - 1).abs() > 1e-3) | (own <= 0))
    if bool(bad.any()):
        b, i = (int(x) for x in bad.nonzero()[0])
        raise InvalidTreeError(f"sequence {b}, draft node {i}: draft_probs is not a distribution that gives the node's "
                               "token positive probability (it must be finite, non-negative and sum to 1)")
