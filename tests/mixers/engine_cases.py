"""What the engine oracle tests (``test_*_engine_oracles.py``) share: the engines' kernels or a
skip, SGLang's accepted-path layout, root paths of parent-index trees, and the chains every op
is checked on."""

from __future__ import annotations

import pytest
import torch

from specla.testing import engine_kernels

# chains of ragged lengths, one long (48 tokens), each with a different accepted prefix (the first
# row's root alone)
CHAIN_LENS, CHAIN_ACCEPTED = [5, 3, 48], [1, 3, 31]


def load_or_skip(loader):
    """The engine's kernel modules, or a skip when the registry is unreachable."""
    try:
        return loader()
    except engine_kernels.RegistryUnreachable as err:
        pytest.skip(str(err))


def accepted_positions(paths: list[list[int]], width: int, draft_token_num: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's ``accept_index`` ``[N, width]`` (flat positions, -1 padded) and ``accept_lens``."""
    idx = torch.full((len(paths), width), -1, dtype=torch.int64)
    for n, p in enumerate(paths):
        idx[n, : len(p)] = torch.tensor(p) + n * draft_token_num
    return idx, torch.tensor([len(p) for p in paths], dtype=torch.int64)


def chain_cu_seqlens(lens: list[int] = CHAIN_LENS) -> torch.Tensor:
    """``cu_seqlens`` ``[len(lens) + 1]`` int32 of packed chains of ``lens`` tokens."""
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
