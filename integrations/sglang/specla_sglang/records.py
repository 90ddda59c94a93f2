"""The factor records of a draft tree, kept in the buffer SGLang's pool has per layer, request row
and draft node, in place of one full state per node. GDN's and Mamba2's records share the layout,
in GDN's names below; a Mamba2 layer's states ``[H, P, Ns]`` take the places of ``(HV, V, K)``,
its ``NG`` groups of ``B`` the key heads' ``H``, its ``B``, ``u = dt x`` and path-summed ``dt A``
the blocks ``k``, ``delta`` and ``G`` (:class:`specla.mixers.mamba2.serving.Mamba2RecordBuffers`).

SGLang's ``MambaPool`` holds ``intermediate_ssm`` ``[layers, R, D, HV, V, K]`` (``R`` = running
requests + 1 padding row, ``D`` draft tokens). This plugin puts there a float32 buffer of shape
``[layers, R, D, W]``, ``W = H * K + HV * V + HV + 1`` (``H`` key heads, ``HV`` value heads, head
dims ``K``, ``V``), so that SGLang sizes it, slices it per layer (``at_layer_idx``) and accounts it
(``mem_usage``) as any tensor of its pool. Its shape gives the sizes, not the memory order: each
layer's memory holds four contiguous blocks, read only through :meth:`RecordLayout.views`:

    ``k [R, D, H, K]`` (L2-normalised keys) | ``delta [R, D, HV, V]`` | ``G [R, D, HV]`` (log decay
    summed along each node's root path) | ``parent [R, D]`` (each node's parent in its tree, ``-1``
    for node 0, a float32 integer: exact below ``2**24``)

``k``, ``delta`` and ``G`` are, as views, the :class:`specla.mixers.gdn.serving.GDNRecordBuffers`
(or ``Mamba2RecordBuffers``) that specla's pool kernels take (one layer's, or every layer's with each layer's block contiguous);
the parents let the commit find an accepted path from this buffer alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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

    def views(self, buffer: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The four blocks of ``buffer`` (``[R, D, W]`` one layer's, or ``[layers, R, D, W]``),
        as views: ``k [..., R, D, H, K]``, ``delta [..., R, D, HV, V]``, ``G [..., R, D, HV]``,
        ``parent [..., R, D]``; each contiguous for one layer's buffer.

        Raises:
            ValueError: ``buffer`` is not a contiguous float32 buffer of this layout's width.
        """
        if buffer.shape[-1] != self.width or not buffer.is_contiguous() or buffer.dim() not in (3, 4):
            raise ValueError(f"a record buffer must be contiguous [(layers,) R, D, {self.width}], "
                             f"got {list(buffer.shape)}")
        *lead, R, D, _ = buffer.shape
        flat = buffer.view(*lead, -1)
        tails = ((self.H, self.K), (self.HV, self.V), (self.HV,), ())
        sizes = [R * D * math.prod(t) for t in tails]
        return tuple(x.view(*lead, R, D, *t) for x, t in zip(flat.split(sizes, -1), tails))
