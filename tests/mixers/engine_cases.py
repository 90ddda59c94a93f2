"""What the engine oracle tests (``test_*_engine_oracles.py``) share: the engines' kernels or a
skip, the device they run on, SGLang's accepted-path layout, root paths of parent-index trees,
and the chains every op is checked on."""

from __future__ import annotations

import pytest
import torch

from specla.testing import engine_kernels
# every tensor a kernel sees is on DEV: compiled kernels on a CUDA machine, Triton's interpreter
# on the CPU (tests/conftest.py); random values are drawn on the CPU (seeded generators) and moved,
# so both devices take the same inputs
from trees import DEV

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
    """SGLang's ``accept_index`` ``[N, width]`` (flat positions, -1 padded) and ``accept_lens``, on
    :data:`DEV`."""
    idx = [[t + n * draft_token_num for t in p] + [-1] * (width - len(p)) for n, p in enumerate(paths)]
    return (torch.tensor(idx, dtype=torch.int64, device=DEV),
            torch.tensor([len(p) for p in paths], dtype=torch.int64, device=DEV))


def chain_cu_seqlens(lens: list[int] = CHAIN_LENS) -> torch.Tensor:
    """``cu_seqlens`` ``[len(lens) + 1]`` int32 of packed chains of ``lens`` tokens, on :data:`DEV`."""
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
