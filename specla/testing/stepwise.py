"""Greedy decoding from a one-token step function: the loop every sequential model walker (a
plugin's ``oracle.py``) decodes with."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor


def stepwise_greedy(step: Callable[[int], Tensor], prompt: list[int], max_new_tokens: int) -> list[int]:
    """Feed ``prompt`` token by token through ``step`` (one token in, that position's logits
    ``[vocab]`` out, the walker's state advanced), then take the argmax ``max_new_tokens``
    times, feeding each choice back. Returns the new tokens only.

    Raises:
        IndexError: an empty ``prompt``.
    """
    for tok in prompt[:-1]:
        step(tok)
    out, tok = [], prompt[-1]
    while len(out) < max_new_tokens:
        tok = int(step(tok).argmax())
        out.append(tok)
    return out
