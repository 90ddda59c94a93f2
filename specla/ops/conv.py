"""Tree-aware causal short convolution (docs/DESIGN.md section 4, short convolution): the batched
PyTorch operators every plugin with a depthwise causal conv uses (GDN's q/k/v conv, Mamba2's conv
over x, B, C, GLA's optional conv). The conv window of a node is its last ``C - 1`` inputs along
its root path, crossing into the committed window. Sequential twins: :mod:`specla.ops.naive`;
Triton kernels: :mod:`specla.ops.conv_triton`.

Shapes: ``B`` sequences, ``T`` tree nodes, ``D`` channels, ``C`` conv width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .norm import compute_dtype


def conv_ancestors(parents: Tensor, width: int) -> Tensor:
    """Index, into ``cat([window, x], 1)``, of each node's last ``width`` inputs along its root path.

    The extended sequence is the committed conv window (``width - 1`` entries, oldest first)
    followed by the ``T`` nodes; a root child's predecessor is the newest window entry.

    Args:
        parents: ``[B, T]`` int64, ``-1`` = child of the committed state.
        width: conv kernel width ``C``.
    Returns:
        ``[B, T, C]`` int64; column ``c`` is the input multiplied by conv tap ``c`` (column
        ``C - 1`` is the node itself), matching ``torch.nn.Conv1d`` causal taps.
    """
    W = width - 1
    B, T = parents.shape
    window_parent = torch.arange(-1, W - 1, device=parents.device).expand(B, W)
    node_parent = torch.where(parents >= 0, parents + W, torch.full_like(parents, W - 1))
    ext_parent = torch.cat([window_parent, node_parent], 1).clamp(min=0)  # [B, W + T]
    cols = [torch.arange(W, W + T, device=parents.device).expand(B, T)]
    for _ in range(W):
        cols.append(ext_parent.gather(1, cols[-1]))
    return torch.stack(cols[::-1], dim=-1)


def tree_conv(x: Tensor, window: Tensor, weight: Tensor, bias: Tensor | None, anc: Tensor, *,
              silu: bool = True) -> Tensor:
    """Tree-aware causal short convolution + SiLU (docs/DESIGN.md section 4, short convolution);
    ``silu=False``: the convolution alone (LFM2's gated short convolution has no activation).

    Args:
        x: ``[B, T, D]`` node inputs (pre-conv projections).
        window: ``[B, C - 1, D]`` committed inputs, oldest first.
        weight: ``[D, C]`` depthwise taps (FLA ``ShortConvolution.weight[:, 0]``).
        bias: ``[D]`` or ``None``.
        anc: ``[B, T, C]`` from :func:`conv_ancestors`.
    Returns:
        ``[B, T, D]`` in ``x.dtype``: ``silu(sum_c weight[:, c] * x_ext[anc[..., c]] + bias)``.
    """
    ext = torch.cat([window, x], 1)
    B, T, C = anc.shape
    taps = ext.gather(1, anc.reshape(B, T * C, 1).expand(-1, -1, ext.shape[-1])).view(B, T, C, -1)
    ct = compute_dtype(x)
    y = torch.einsum("btcd,dc->btd", taps.to(ct), weight.to(ct))
    if bias is not None:
        y = y + bias.to(ct)
    return (F.silu(y) if silu else y).to(x.dtype)


def conv_window_after(x: Tensor, window: Tensor, path: Tensor, path_len: Tensor) -> Tensor:
    """Conv window after committing an accepted path.

    Args:
        x: ``[B, T, D]`` node inputs; window: ``[B, C - 1, D]`` (oldest first);
        path: ``[B, P]`` int64 root-to-leaf node indices, ``-1`` padded; path_len: ``[B]`` int64.
    Returns:
        ``[B, C - 1, D]``: the last ``C - 1`` inputs of ``window`` followed by the path's inputs;
        bit-identical to ``window`` where ``path_len == 0``.
    """
    W = window.shape[1]
    if W == 0:
        return window
    pos = path_len[:, None] + torch.arange(W, device=x.device)  # position in [window, path inputs]
    node = path.gather(1, (pos - W).clamp(0, max(path.shape[1] - 1, 0))) if path.shape[1] else pos * 0
    idx = torch.where(pos < W, pos, W + node)
    return torch.cat([window, x], 1).gather(1, idx[..., None].expand(-1, -1, x.shape[-1]))


def conv_windows_per_node(x: Tensor, window: Tensor, anc: Tensor) -> Tensor:
    """Conv window after each node's root path (for the snapshot strategy).

    Args: x ``[B, T, D]``, window ``[B, C - 1, D]``, anc ``[B, T, C]`` from :func:`conv_ancestors`.
    Returns: ``[B, T, C - 1, D]``.
    """
    B, T, C = anc.shape
    ext = torch.cat([window, x], 1)
    idx = anc[..., 1:].reshape(B, T * (C - 1), 1).expand(-1, -1, ext.shape[-1])
    return ext.gather(1, idx).view(B, T, C - 1, -1)


def causal_conv(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """Causal depthwise short convolution + SiLU of whole sequences from an empty window (FLA
    ``ShortConvolution``): :func:`tree_conv` on a chain with a zero window.

    Args: x ``[B, T, D]``, weight ``[D, C]``, bias ``[D]`` or ``None``.
    Returns: ``[B, T, D]`` in ``x.dtype``.
    """
    ct = compute_dtype(x)
    C = weight.shape[1]
    y = F.conv1d(F.pad(x.to(ct).transpose(1, 2), (C - 1, 0)), weight.to(ct)[:, None],
                 bias.to(ct) if bias is not None else None, groups=weight.shape[0])
    return F.silu(y.transpose(1, 2)).to(x.dtype)
