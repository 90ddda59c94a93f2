"""Architecture-agnostic operators the plugins share (FLA keeps the like in ``fla.modules``):
tree-aware short convolution (PyTorch, sequential twin, Triton kernels), normalisations, and softmax
attention under a draft tree over a fixed-capacity KV cache with its commit (``attention``), and
the kernels of a recorded step's bookkeeping (top-k, greedy acceptance, ancestor masks). Nothing
here names an architecture."""

import torch


def check_out(out, shape: tuple, dtypes: tuple, device) -> None:
    """Preallocated outputs must be what the kernels write: contiguous, of ``shape`` and the given
    dtypes, on ``device`` (a kernel writing past a smaller buffer corrupts memory).

    Raises:
        ValueError: naming the expected and the given layout.
    """
    if len(out) != len(dtypes) or any(
            tuple(t.shape) != tuple(shape) or t.dtype != d or not t.is_contiguous() or t.device != torch.device(device)
            for t, d in zip(out, dtypes)):
        got = [(tuple(t.shape), t.dtype, t.is_contiguous(), str(t.device)) for t in out]
        raise ValueError(f"out must be {len(dtypes)} contiguous tensors of shape {tuple(shape)} and dtypes "
                         f"{[str(d) for d in dtypes]} on {device}; got (shape, dtype, contiguous, device) {got}")
