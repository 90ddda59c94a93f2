"""Tree shapes used across tests (not collected: no test_ prefix)."""

import random

SHAPES = ("single", "chain", "star", "binary", "random")


def tree_parents(kind: str, n: int, rng: random.Random) -> list[int]:
    """Parents (``-1`` = child of the committed state) of an ``n``-node tree of shape ``kind``."""
    if kind == "single" or n == 1:
        return [-1]
    if kind == "chain":
        return list(range(-1, n - 1))
    if kind == "star":
        return [-1] + [0] * (n - 1)
    if kind == "binary":
        return [-1] + [(i - 1) // 2 for i in range(1, n)]
    return [rng.randrange(-1, i) for i in range(n)]
