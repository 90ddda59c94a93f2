"""The factor records of a draft tree, packed into the buffer SGLang's pool keeps per layer, request
row and draft node in place of one full state per node.

SGLang's ``MambaPool`` holds ``intermediate_ssm`` ``[layers, rows, D, HV, V, K]`` (``rows`` = running
requests + 1 padding row, ``D`` draft tokens). This plugin puts there ``[layers, rows, D, W]``
float32, one row of ``W = H * K + HV * V + HV + 1`` per node, laid out as

    ``k [H, K]`` (L2-normalised key) | ``delta [HV, V]`` | ``G [HV]`` (log decay summed along the
    node's root path) | ``parent`` (the node's parent within the tree, ``-1`` for node 0)

so every tensor SGLang sizes, slices per layer (``at_layer_idx``) and accounts (``mem_usage``)
stays a plain tensor. The parent is stored as a float32 integer (exact below ``2**24``): the commit
then needs nothing but this buffer. ``k``, ``delta`` and ``G`` are a
:class:`specla.mixers.gdn.records.GDNFactorRecord`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class RecordLayout:
    """Widths of one node's record: ``H`` key heads, ``HV`` value heads, head dims ``K``, ``V``."""

    H: int
    HV: int
    K: int
    V: int

    @property
    def width(self) -> int:
        """``W``, float32 elements per node."""
        return self.H * self.K + self.HV * self.V + self.HV + 1

    @classmethod
    def of_buffer(cls, temporal_shape: tuple[int, ...], width: int) -> "RecordLayout":
        """The layout of a record buffer of last dimension ``width`` next to a state pool whose
        last three dimensions are SGLang's ``(HV, V, K)``.

        Raises:
            ValueError: ``width`` fits no whole number of key heads.
        """
        HV, V, K = temporal_shape[-3:]
        H, rest = divmod(width - HV * V - HV - 1, K)
        if rest or H <= 0 or HV % H:
            raise ValueError(f"a record width of {width} does not fit states of shape (HV, V, K) = {(HV, V, K)}")
        return cls(H=H, HV=HV, K=K, V=V)

    def unpack(self, rec: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Views of ``rec [..., W]``: ``k [..., H, K]``, ``delta [..., HV, V]``, ``G [..., HV]``,
        ``parent [...]`` (float32; see the module docstring)."""
        a = self.H * self.K
        b = a + self.HV * self.V
        return (rec[..., :a].unflatten(-1, (self.H, self.K)), rec[..., a:b].unflatten(-1, (self.HV, self.V)),
                rec[..., b:b + self.HV], rec[..., -1])

    def pack(self, k: Tensor, delta: Tensor, G: Tensor, parents: Tensor) -> Tensor:
        """``[..., W]`` float32 from ``k [..., H, K]``, ``delta [..., HV, V]``, ``G [..., HV]`` and
        integer ``parents [...]``."""
        return torch.cat([k.flatten(-2).float(), delta.flatten(-2).float(), G.float(), parents.float()[..., None]], -1)
