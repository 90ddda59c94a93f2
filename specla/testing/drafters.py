"""Drafters that force acceptance patterns, and acceptances along chosen paths, for conformance
tests."""

from __future__ import annotations

import torch

from ..interfaces import Drafter
from ..records import Acceptance
from ..tree import DraftTree


def path_acceptance(tree: DraftTree, ends: list[int], bonus: list[int]) -> Acceptance:
    """The :class:`Acceptance` that accepts, in each sequence ``b``, the root path of draft node
    ``ends[b]`` (``-1``: no draft), then the token ``bonus[b]``; on the tree's device.

    Args:
        tree: the verified tree (``B`` sequences).
        ends: ``B`` draft-node indices of ``tree`` (or ``-1``).
        bonus: ``B`` token ids.
    """
    B = tree.batch_size
    paths = [[0] + [n + 1 for n in (tree.path(b, e) if e >= 0 else [])] for b, e in enumerate(ends)]
    P = max(len(p) for p in paths)
    path = torch.tensor([p + [-1] * (P - len(p)) for p in paths])
    num = torch.tensor([len(p) - 1 for p in paths])
    toks = torch.tensor([[int(tree.tokens[b, n - 1]) for n in p[1:]] + [-1] * (P - len(p))
                         for b, p in enumerate(paths)])
    dev = tree.tokens.device
    return Acceptance(path=path.to(dev), num_accepted=num.to(dev), bonus=torch.tensor(bonus, device=dev),
                      tokens=toks.view(B, P - 1).to(dev))


class OracleDrafter(Drafter):
    """Knows each prompt's greedy autoregressive continuation and drafts from it, corrupting
    chosen positions, so every acceptance pattern can be forced.

    Patterns: ``all`` (every draft right), ``none`` (every draft wrong), ``alternating`` (every
    other draft wrong, shifting each step), ``zero_after_many`` (a full right chain, then a step
    with no drafts, repeating), ``tree`` (a wrong first child with its own subtree, then the right
    chain as a second child), ``mixed`` (sequence 0 of the batch drafts nothing while the others
    draft their full right chain).

    Args:
        prompts: the batch's prompts (token ids).
        continuations: each prompt's greedy autoregressive continuation, at least as long as the
            generation plus ``num_draft_tokens``.
        pattern: one of the patterns above.
        vocab_size: wrong drafts are ``(right + 1) % vocab_size``.
    Raises:
        ValueError: an unknown pattern (on the first :meth:`propose`).
    """

    PATTERNS = ("all", "none", "alternating", "zero_after_many", "tree", "mixed")

    name = "oracle"

    def __init__(self, prompts, continuations, pattern, vocab_size):
        self.prompts, self.refs, self.pattern, self.V = prompts, continuations, pattern, vocab_size
        self.active = list(range(len(prompts)))
        self.step = 0

    def reset(self, prompts):
        self.active = list(range(len(prompts)))
        self.step = 0

    def select(self, index):
        self.active = [self.active[i] for i in index.tolist()]

    def propose(self, contexts, config):
        depth = min(config.max_depth, config.num_draft_tokens)
        trees = []
        for seq, ctx in zip(self.active, contexts):
            pos = len(ctx) - len(self.prompts[seq])
            true = self.refs[seq][pos : pos + depth]
            wrong = [(t + 1) % self.V for t in true]
            p = self.pattern
            if p == "all":
                toks = true
            elif p == "none":
                toks = wrong
            elif p == "alternating":
                toks = [w if (j + self.step) % 2 else t for j, (t, w) in enumerate(zip(true, wrong))]
            elif p == "zero_after_many":
                toks = true if self.step % 2 == 0 else []
            elif p == "mixed":
                toks = [] if seq == 0 else true
            elif p == "tree":
                half = max(config.num_draft_tokens // 2, 1)
                w = wrong[: min(half, depth)]
                t = true[: config.num_draft_tokens - len(w)]
                toks = w + t
                parents = list(range(-1, len(w) - 1)) + [-1 if j == 0 else len(w) + j - 1 for j in range(len(t))]
                trees.append((toks, parents))
                continue
            else:
                raise ValueError(f"unknown pattern {p!r}; known: {self.PATTERNS}")
            trees.append((toks, list(range(-1, len(toks) - 1))))
        self.step += 1
        return DraftTree.from_lists(trees)


class ScriptedDrafter(Drafter):
    """Replays drafted trees from a script (for property-based fuzzing): per step, per sequence,
    a list of ``(parent, kind)`` where ``kind`` is ``"right"`` (the reference continuation along
    the node's path), ``"wrong"`` or an int (a wrong token offset); out-of-range parents become
    root children, and the tree is cut to the budget, ancestor-closed.

    Args:
        prompts, refs: the batch's prompts and their greedy continuations.
        script: the steps (cycled; sequence ``s`` starts ``s`` steps in).
        vocab_size: wrong tokens wrap around it.
    """

    name = "scripted"

    def __init__(self, prompts, refs, script, vocab_size):
        self.prompts, self.refs, self.script, self.V = prompts, refs, script, vocab_size
        self.active, self.step = list(range(len(prompts))), 0

    def reset(self, prompts):
        self.active, self.step = list(range(len(prompts))), 0

    def select(self, index):
        self.active = [self.active[i] for i in index.tolist()]

    def propose(self, contexts, config):
        trees = []
        for seq, ctx in zip(self.active, contexts):
            spec = self.script[(self.step + seq) % len(self.script)]
            pos = len(ctx) - len(self.prompts[seq])
            tokens, parents, depth = [], [], []
            for parent, kind in spec:
                parent = parent if parent < len(tokens) else -1
                d = 1 if parent < 0 else depth[parent] + 1
                ref = self.refs[seq][pos + d - 1] if pos + d - 1 < len(self.refs[seq]) else 0
                tokens.append(ref if kind == "right" else (ref + 1 + kind) % self.V if isinstance(kind, int) else (ref + 1) % self.V)
                parents.append(parent)
                depth.append(d)
            keep = [i for i in range(len(tokens)) if depth[i] <= config.max_depth][: config.num_draft_tokens]
            keep = [i for i in keep if parents[i] < 0 or parents[i] in keep]  # stay ancestor-closed
            pos_of = {i: j for j, i in enumerate(keep)}
            trees.append(([tokens[i] for i in keep], [pos_of[parents[i]] if parents[i] >= 0 else -1 for i in keep]))
        self.step += 1
        return DraftTree.from_lists(trees)
