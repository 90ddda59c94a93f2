"""Mamba2 (SSD) as a sequence mixer (:class:`specla.mixers.Mixer`): what every Mamba2 layer runs,
in FLA's pure Mamba2 models and in the hybrids of transformers' classes (Bamba, Granite 4.0-H,
Nemotron-H, Falcon-H1), with its records, reference path and Triton kernels (this package's ``records``,
``reference``, ``verify`` and ``commit``).

Shapes: ``B`` sequences, ``T`` verified nodes (root explicit), ``H`` SSM heads, ``P`` head dim,
``N`` state size, ``G`` groups of the SSM matrices, ``Di = H P``, ``Dc = Di + 2 G N`` conv
channels (``x, B, C``), ``C`` conv width. The state of a head is ``[N, P]`` (the ``[K, V]``
layout of the other plugins; FLA's and transformers' caches hold it transposed).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from specla.baselines import ReplayRecord
from specla.mixers import RecurrentMixer, TreePass
from specla.ops import fla_installed, kernels
from specla.ops.conv import tree_conv
from specla.records import LayerCommit, Record

from .records import Mamba2FactorRecord
from .reference import discretize, expand_groups, node_states, ssd_commit_factor, ssd_commit_replay, tree_ssd

conv_kernels = kernels("specla.ops.conv_triton")
verify_kernels = kernels("specla.mixers.mamba2.verify")
commit_kernels = kernels("specla.mixers.mamba2.commit")


class Mamba2Mixer(RecurrentMixer):
    """One Mamba2 layer's sequence mixer (Dao & Gu 2024, arXiv 2405.21060): the input projection
    split into the gate ``z``, the conv input ``xBC`` and ``dt``; tree-aware depthwise causal
    conv + SiLU over ``xBC``, split into ``x, B, C``; ``dt = clamp(softplus(dt + dt_bias),
    *dt_limit)``, ``A = -exp(A_log)``; the tree-masked SSD with the ``D`` skip and records of the
    pass's kind (docs/DESIGN.md section 5); then ``output(y, z)`` (the gated norm and output
    projection of the model).

    State: ``S [B, H, N, P]`` in ``state_dtype`` (float32, or float64 for float64 runs) and the
    conv window ``[B, C - 1, Dc]`` in the activation dtype.

    Args:
        project: ``h [B, T, hidden] -> (z [B, T, Di] or None, xBC [B, T, Dc], dt [B, T, H])``:
            the layer's input projection (the model's own module), before the conv.
        conv_w: ``[Dc, C]`` depthwise taps. conv_b: ``[Dc]`` or ``None``.
        A_log, dt_bias: ``[H]`` in ``state_dtype``. D: ``[H]`` or ``[H, P]`` in ``state_dtype``.
        dt_limit: ``(min, max)`` clamp of the step size (``(0, inf)``: none).
        H, P, N, G: heads, head dim, state size, groups.
        output: ``(y [B, T, Di] state dtype, z) -> [B, T, hidden]``: the model's gated norm and
            output projection.
        dtype, state_dtype, device: activations, recurrent state, device.
    """

    baselines = frozenset({"snapshot", "replay"})
    replay_commit = staticmethod(ssd_commit_replay)  # a replay record's inputs: Bm, u, a

    def __init__(self, *, project: Callable[[Tensor], tuple], conv_w: Tensor, conv_b: Tensor | None, A_log: Tensor,
                 dt_bias: Tensor, D: Tensor, dt_limit: tuple[float, float], H: int, P: int, N: int, G: int,
                 output: Callable[[Tensor, Tensor | None], Tensor], dtype: torch.dtype, state_dtype: torch.dtype,
                 device: torch.device):
        self.project, self.output = project, output
        self.conv_w, self.conv_b = conv_w, conv_b
        self.A_log, self.dt_bias, self.D, self.dt_limit = A_log, dt_bias, D, dt_limit
        self.H, self.P, self.N, self.G = H, P, N, G
        self.dtype, self.state_dtype, self.device = dtype, state_dtype, device
        self.C = conv_w.shape[1]
        self.empty_state(0, 0)

    def empty_record(self, B: int, T: int) -> Mamba2FactorRecord:
        z = lambda *s, dtype=self.state_dtype: torch.zeros(B, T, *s, dtype=dtype, device=self.device)  # noqa: E731
        return Mamba2FactorRecord(Bm=z(self.G, self.N, dtype=self.dtype), u=z(self.H, self.P), G=z(self.H),
                                  conv_x=z(self.conv_w.shape[0], dtype=self.dtype))

    def empty_state(self, B: int, capacity: int) -> None:
        self.S = torch.zeros(B, self.H, self.N, self.P, dtype=self.state_dtype, device=self.device)
        self.conv = torch.zeros(B, self.C - 1, self.conv_w.shape[0], dtype=self.dtype, device=self.device)

    def verify(self, h: Tensor, tp: TreePass, pending: LayerCommit | None) -> tuple[Tensor, Record]:
        kernel = tp.kernels
        # one kernel for every layer of the pass: serial (chains), parallel, or the reference
        # path for a tree too large for the parallel kernel
        choice = tp.shared("mamba2-kernel", lambda: tp.choose(verify_kernels.pick_verify_kernel)) if kernel else "reference"
        if pending is not None:  # the delayed commit of the previous step, conv window first
            prev, path, path_len = pending
            self.commit_window(prev.conv_x, path, path_len, kernel)
            if kernel and choice == "reference":  # commit in place, then verify unfused
                commit_kernels.flush_commit(self.S, pending)
            elif not kernel:
                self.S = ssd_commit_factor(self.S, prev.Bm, prev.u, prev.G, path, path_len)
        B, T = h.shape[:2]
        H, P, N, G = self.H, self.P, self.N, self.G
        z, xbc_in, dt_raw = self.project(h)
        anc = tp.conv_ancestors(self.C)
        xbc = (conv_kernels.tree_conv if kernel else tree_conv)(xbc_in, self.conv, self.conv_w, self.conv_b, anc)
        xs, Bm, Cm = xbc.split([H * P, G * N, G * N], dim=-1)
        xs, Bm, Cm = xs.reshape(B, T, H, P), Bm.reshape(B, T, G, N), Cm.reshape(B, T, G, N)
        dt, a = discretize(dt_raw, self.dt_bias, self.A_log, self.dt_limit)
        S0 = self.S
        fused = None if choice == "reference" else pending
        if choice == "serial":  # the kernels apply the pending commit to S0 in place first
            y, u, Gs = verify_kernels.serial_verify(xs, dt, a, Bm, Cm, self.D, S0, tp.counts, pending=fused)
        elif choice == "parallel":
            y, u, Gs = verify_kernels.tree_verify(xs, dt, a, Bm, Cm, self.D, S0, tp.mask, pending=fused)
        else:
            y, u, Gs = tree_ssd(xs, dt, a, Bm, Cm, self.D, S0, tp.mask)
        if tp.records == "replay":
            rec = ReplayRecord((Bm, u, a.to(self.state_dtype)), xbc_in)
        else:
            rec = Mamba2FactorRecord(Bm=Bm, u=u, G=Gs, conv_x=xbc_in)
        return self.output(y.reshape(B, T, H * P), z), rec

    def node_states(self, record: Mamba2FactorRecord, tp: TreePass) -> list[Tensor]:
        return [node_states(self.S, record.Bm, record.u, record.G, tp.mask), *self.window_states(record.conv_x, tp)]

    def prefills_whole(self, kernels: bool) -> bool:
        # FLA's chunk kernels autotune, which needs a GPU driver (Triton's CPU interpreter has none)
        return kernels and self.device.type == "cuda" and fla_installed()

    def prefill(self, h: Tensor, tp: TreePass) -> Tensor:
        """Whole prompts (:meth:`specla.mixers.Mixer.prefill`) on the kernel path: the tree
        short-conv kernel along the chain and its window commit at ``tp.counts``, then SSD as
        FLA's chunked simple GLA (``chunk_simple_gla``: per-head scalar decay ``g = a``, keys
        ``Bm``, queries ``Cm``, values ``u = dt * x``, scale 1; the state ``[N, P]`` is its
        ``[K, V]``), in float32, from the state the layer holds (empty at a prompt's start); then the ``D`` skip. Padding rows get
        ``a = 0`` and ``u = 0``, which leave the state as it is (``S <- exp(a) S + Bm u^T``)."""
        from fla.ops.simple_gla import chunk_simple_gla

        B, T = h.shape[:2]
        H, P, N, G = self.H, self.P, self.N, self.G
        path, pad = tp.chain()
        z, xbc_in, dt_raw = self.project(h)
        xbc = conv_kernels.tree_conv(xbc_in, self.conv, self.conv_w, self.conv_b, tp.conv_ancestors(self.C))
        self.commit_window(xbc_in, path, tp.counts, True)
        xs, Bm, Cm = xbc.split([H * P, G * N, G * N], dim=-1)
        xs = xs.reshape(B, T, H, P).to(self.state_dtype)
        Bm, Cm = (expand_groups(m.reshape(B, T, G, N), H).to(self.state_dtype) for m in (Bm, Cm))
        dt, a = discretize(dt_raw, self.dt_bias, self.A_log, self.dt_limit)
        a = a.to(self.state_dtype).masked_fill(pad[..., None], 0.0)
        u = (dt.to(self.state_dtype)[..., None] * xs).masked_fill(pad[..., None, None], 0.0)
        y, S = chunk_simple_gla(Cm, Bm, u, g=a, scale=1.0, initial_state=self.S, output_final_state=True)
        self.S = S.to(self.state_dtype)
        D = self.D.to(self.state_dtype)
        y = y + (D[:, None] if D.dim() == 1 else D) * xs
        return self.output(y.reshape(B, T, H * P), z)

    def commit(self, pending: LayerCommit, kernels: bool) -> None:
        record, path, path_len = pending
        if kernels:
            commit_kernels.flush_commit(self.S, pending)  # in place
        else:
            self.S = ssd_commit_factor(self.S, record.Bm, record.u, record.G, path, path_len)
        self.commit_window(record.conv_x, path, path_len, kernels)
