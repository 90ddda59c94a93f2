"""Greedy tree speculation of a small model against its plain decoding, for the engine oracle tests
(``test_*_engine_oracles.py``): random ragged draft trees that know part of the answer, verified
in one pass a step, accepted greedily, committed. The tensors handed to the callbacks are on
:data:`engine_cases.DEV`, as the model's must be."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine_cases import DEV


def speculate(plain: list[list[int]], roots: list[int], sizes: list[int], vocab: int, seed: int,
              verify: Callable[[list[int], torch.Tensor, torch.Tensor], list[int]],
              commit: Callable[[list[list[int]]], None]) -> tuple[list[list[int]], list[int]]:
    """Decode ``len(plain[0])`` tokens a row by tree speculation.

    Each step drafts a random tree of ``sizes[n]`` nodes (root included: the last token) for row
    ``n``, deep rather than wide, one branch following the plain tokens for a random depth, the
    other branches wrong, so steps accept from nothing to a whole branch.

    Args:
        plain: the rows' plain greedy tokens (the drafter's knowledge; all of one length).
        roots: each row's last token. sizes: draft nodes a row. vocab: tokens. seed: the trees'.
        verify: ``(tokens [Ttot] packed, cu_seqlens [N + 1] int32, parents [N, max(sizes)]
            int64, padded with 0, on DEV) -> the target's greedy token after each node``.
        commit: the rows' accepted paths (node indices, root to leaf).
    Returns:
        ``(tokens, accepted)``: each row's decoded tokens (at least as many as ``plain``'s),
        and the accepted draft nodes (root excluded) of every row and step.
    """
    gen = torch.Generator().manual_seed(seed)
    new, N, width = len(plain[0]), len(plain), max(sizes)
    out, roots, accepted = [[] for _ in range(N)], list(roots), []
    starts = [0, *torch.tensor(sizes).cumsum(0).tolist()]
    qsl = torch.tensor(starts, dtype=torch.int32, device=DEV)
    while min(len(o) for o in out) < new:
        trees, toks = [], []
        for n in range(N):
            par, tok, true_depth = [-1], [roots[n]], {0: 0}
            for i in range(1, sizes[n]):
                p = int(torch.randint(max(0, i - 2), i, (1,), generator=gen))
                par.append(p)
                want = plain[n][len(out[n]) + true_depth[p]] if p in true_depth and \
                    len(out[n]) + true_depth[p] < new else None
                if want is not None and torch.rand((), generator=gen) < 0.7 and \
                        not any(par[j] == p and j in true_depth for j in range(1, i)):
                    tok.append(want)
                    true_depth[i] = true_depth[p] + 1
                else:
                    wrong = (want if want is not None else 0) + 1 + int(torch.randint(0, 3, (1,), generator=gen))
                    tok.append(wrong % vocab)
            trees.append(par + [0] * (width - sizes[n]))
            toks += tok
        pred = verify(toks, qsl, torch.tensor(trees, device=DEV))
        paths = []
        for n in range(N):  # greedy acceptance: follow the child holding the target's token
            base, path = starts[n], [0]
            while True:
                want = pred[base + path[-1]]
                nxt = [c for c in range(1, sizes[n]) if trees[n][c] == path[-1] and toks[base + c] == want]
                if not nxt:
                    break
                path.append(nxt[0])
            out[n] += [toks[base + c] for c in path[1:]] + [pred[base + path[-1]]]
            roots[n] = pred[base + path[-1]]
            paths.append(path)
            accepted.append(len(path) - 1)
        commit(paths)
    return out, accepted


def plain_decode(step: Callable[[torch.Tensor], torch.Tensor], prompts: torch.Tensor, new: int) -> list[list[int]]:
    """Greedy decoding one token a row a step: ``step(tokens [N]) -> logits [N, vocab]`` (the
    model through the engine's decode kernel, states kept by the caller), ``prompts [N, L]`` (on
    the model's device); returns the ``new`` tokens after each prompt."""
    plain, tokens = [], prompts[:, 0]
    for t in range(prompts.shape[1] + new - 1):
        nxt = step(tokens).argmax(-1)
        tokens = prompts[:, t + 1] if t + 1 < prompts.shape[1] else nxt
        if t + 1 >= prompts.shape[1]:
            plain.append(nxt)
    return torch.stack(plain, 1).tolist()
