"""Prompt-lookup (n-gram) drafting: training-free, works with any target.

Finds earlier occurrences of the context's last ``n`` tokens (longest ``n`` first) and proposes
the tokens that followed them (Saxena 2023, "prompt lookup decoding"; vLLM's ``ngram`` proposer).
With ``top_k > 1`` the continuations of several matches are merged into a tree (a trie), so
different continuations of the same n-gram are verified in one pass.
"""

from __future__ import annotations

from ..config import SpecConfig
from ..interfaces import Drafter
from ..tree import DraftTree


class NgramDrafter(Drafter):
    """Prompt-lookup drafter.

    Args:
        max_ngram: longest suffix to match (tried first).
        min_ngram: shortest suffix to match.
        max_matches: most matches (most recent first) merged into one tree.

    Raises:
        ValueError: ``1 <= min_ngram <= max_ngram`` or ``max_matches >= 1`` violated.
    """

    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_matches: int = 8):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if max_matches < 1:
            raise ValueError(f"max_matches must be >= 1, got {max_matches}")
        self.max_ngram, self.min_ngram, self.max_matches = max_ngram, min_ngram, max_matches

    def continuations(self, context: list[int], depth: int) -> list[list[int]]:
        """Up to ``max_matches`` continuations (each at most ``depth`` tokens) of the longest
        suffix of ``context`` that occurred before, most recent match first."""
        L = len(context)
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            suffix = context[L - n :]
            found = []
            for end in range(L - 1, n - 1, -1):  # end: index just after an earlier occurrence
                if context[end - n : end] == suffix:
                    found.append(context[end : end + depth])
                    if len(found) == self.max_matches:
                        break
            if found:
                return found
        return []

    def propose(self, contexts: list[list[int]], config: SpecConfig) -> DraftTree:
        budget = config.num_draft_tokens
        depth = min(config.max_depth, budget)
        trees = []
        for ctx in contexts:
            tokens: list[int] = []
            parents: list[int] = []
            children: dict[int, dict[int, int]] = {-1: {}}  # node -> {token: child node}
            for cont in self.continuations(ctx, depth) if budget else []:
                node = -1
                for tok in cont:
                    kids = children[node]
                    if tok not in kids:
                        if len(kids) >= config.top_k or len(tokens) >= budget:
                            break
                        kids[tok] = len(tokens)
                        children[len(tokens)] = {}
                        tokens.append(tok)
                        parents.append(node)
                    node = kids[tok]
            trees.append((tokens, parents))
        return DraftTree.from_lists(trees)
