"""Tree shapes and comparison helpers used across tests (not collected: no test_ prefix)."""

import os
import random

import pytest
import torch

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}  # operator vs sequential twin, by dtype


DEV = "cuda" if torch.cuda.is_available() else "cpu"
# Triton kernels run compiled on a GPU, interpreted on a CPU with TRITON_INTERPRET=1 (conftest sets it)
needs_triton = pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                  reason="Triton kernels need a GPU or TRITON_INTERPRET=1")


def for_kernels(model: torch.nn.Module, kernels: str) -> torch.nn.Module:
    """The model a test runs with ``kernels``: ``model`` itself, or for ``"triton"`` on a CUDA
    machine (where the kernels are compiled, not interpreted) a copy on the GPU."""
    if kernels == "triton" and torch.cuda.is_available():
        import copy

        return copy.deepcopy(model).to("cuda")
    return model


def rel_err(a, b) -> float:
    """Largest absolute difference over the largest reference magnitude."""
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def f64(x):
    """``x`` in float64 on the test device: float64 references of the GPU-shape kernel tests run
    there (on the GPU machine's shared CPU they took minutes at those shapes)."""
    return x.to(DEV, torch.float64)

def ragged_pending():
    """Accepted paths of a ragged pending commit for a batch of 4 (root-explicit node indices):
    3, 1, 0 (nothing pending: that state must stay bit-identical) and 2 nodes. Returns
    ``(path [4, 3], path_len [4])`` int64."""
    return torch.tensor([[0, 1, 2], [0, -1, -1], [-1, -1, -1], [0, 1, -1]]), torch.tensor([3, 1, 0, 2])


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


def batch_parents(kind: str, sizes: list[int], rng: random.Random):
    """``[B, T]`` parents of one ``kind`` tree per size; shorter rows are padded with extra
    children of the committed state (separate branches)."""
    sizes = [1] * len(sizes) if kind == "single" else sizes
    T = max(sizes)
    return torch.tensor([tree_parents(kind, n, rng) + [-1] * (T - n) for n in sizes])
