"""Turns an FLA ``Mamba2ForCausalLM`` into a :class:`specla.TargetAdapter`.

The reference path: the whole model runs layer-major over the draft tree in PyTorch from the
model's own weights (FLA's cached path takes one new token per step, so tree verify is ours). Per
block, following FLA's ``Mamba2Block`` and ``Mamba2.torch_forward``: RMSNorm, ``in_proj`` split
into ``z, xBC, dt``; tree-aware depthwise causal conv + SiLU over ``xBC``, split into ``x, B, C``;
``dt = clamp(softplus(dt + dt_bias), *dt_limit)``, ``A = -exp(A_log)``; tree-masked SSD with
factor records and the ``D`` skip; gated RMSNorm with ``z`` (or ``y * silu(z)`` without it);
``out_proj``; residual (added in float32 with ``residual_in_fp32``). Final ``norm_f``, LM head.
With ``SpecConfig(kernels="triton")`` (factor commit, float32 state) the conv, the SSD verify with
the fused delayed commit, and ``flush`` run the plugin's Triton kernels instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from specla.config import SpecConfig
from specla.layerwise import LayerwiseAdapter, eos_token_ids
from specla.records import PendingCommit, Record, path_end
from specla.tree import inclusive_ancestor_mask

from .records import Mamba2FactorRecord, Mamba2ReplayRecord, Mamba2SnapshotRecord
from specla.ops import conv_triton as conv_kernels
from specla.ops.conv import conv_ancestors, conv_window_after, conv_windows_per_node, tree_conv
from specla.ops.norm import rms_norm

from .reference import discretize, gated_rms_norm, node_states, ssd_commit_factor, ssd_commit_replay, tree_ssd
from .commit import flush_commit
from .verify import pick_verify_kernel, serial_verify, tree_verify



@dataclass
class _Layer:
    """One Mamba2 block's weights, converted once to the run's device and dtype."""

    norm: Tensor  # [hidden]
    norm_eps: float
    residual_fp32: bool
    w_in: Tensor  # [Di + Dc + H, hidden]
    b_in: Tensor | None
    conv_w: Tensor  # [Dc, C]
    conv_b: Tensor | None  # [Dc]
    A_log: Tensor  # [H] state dtype
    dt_bias: Tensor  # [H] state dtype
    dt_limit: tuple[float, float]
    D: Tensor  # [H] or [H, P] state dtype
    gnorm: Tensor | None  # [Di], None without the gated RMSNorm (rmsnorm=False)
    gnorm_eps: float
    group_size: int
    norm_before_gate: bool
    w_out: Tensor  # [hidden, Di]
    b_out: Tensor | None
    H: int
    P: int
    N: int
    G: int


class Mamba2Adapter(LayerwiseAdapter):
    """Reference-path adapter for Mamba2 (see module docstring).

    State per sequence: ``recurrent[l]`` ``[B, H, N, P]`` float32 (float64 for float64 runs),
    ``conv[l]`` ``[B, C - 1, Dc]`` activation dtype, ``roots`` ``[B]`` int64. Weights are read from
    ``model`` once; ``model`` itself is not modified.

    Args:
        model: a ``fla.models.Mamba2ForCausalLM`` (checked by the plugin).
        config: the run's :class:`SpecConfig` (``dtype``/``device`` override the model's).
    """

    def __init__(self, model: torch.nn.Module, config: SpecConfig):
        ref = model.lm_head.weight
        self._place(config, ref)
        act = lambda p: p.detach().to(self.device, self.dtype) if p is not None else None  # noqa: E731
        st = lambda p: p.detach().to(self.device, self.state_dtype)  # noqa: E731
        bb = model.backbone
        self.embed_weight = act(bb.embeddings.weight)
        self.vocab_size = self.embed_weight.shape[0]
        self.eos_token_ids = eos_token_ids(model)
        self.norm, self.norm_eps = act(bb.norm_f.weight), bb.norm_f.eps
        self.lm_head = act(model.lm_head.weight)
        self.layers = []
        for blk in bb.layers:
            m = blk.mixer
            self.layers.append(
                _Layer(
                    norm=act(blk.norm.weight), norm_eps=blk.norm.eps, residual_fp32=blk.residual_in_fp32,
                    w_in=act(m.in_proj.weight), b_in=act(m.in_proj.bias),
                    conv_w=act(m.conv1d.weight[:, 0]), conv_b=act(m.conv1d.bias),
                    A_log=st(m.A_log), dt_bias=st(m.dt_bias), dt_limit=tuple(float(v) for v in m.dt_limit),
                    D=st(m.D).view(m.num_heads, m.head_dim) if m.D_has_hdim else st(m.D),
                    gnorm=act(m.norm.weight) if m.rmsnorm else None,
                    gnorm_eps=m.norm.eps if m.rmsnorm else 0.0,
                    group_size=m.norm.group_size if m.rmsnorm else 0,
                    norm_before_gate=m.norm_before_gate,
                    w_out=act(m.out_proj.weight), b_out=act(m.out_proj.bias),
                    H=m.num_heads, P=m.head_dim, N=m.ssm_state_size, G=m.n_groups,
                )
            )
        self.conv_width = self.layers[0].conv_w.shape[1]
        self._init_state()

    # ------------------------------------------------------------------ state
    def _empty_state(self, B: int) -> None:
        self.recurrent = [
            torch.zeros(B, L.H, L.N, L.P, dtype=self.state_dtype, device=self.device) for L in self.layers
        ]
        self.conv = [
            torch.zeros(B, self.conv_width - 1, L.conv_w.shape[0], dtype=self.dtype, device=self.device)
            for L in self.layers
        ]

    # ------------------------------------------------------------------ model
    @torch.no_grad()
    def forward(self, tokens: Tensor, parents: Tensor, counts: Tensor, records: str, logits: bool = True,
                pending: PendingCommit | None = None):
        """Run the model over a batch of trees hanging from the committed state.

        Args:
            tokens: ``[B, T]`` int64 node tokens (already validated).
            parents: ``[B, T]`` int64, ``-1`` = child of the committed state.
            counts: ``[B]`` int64 real nodes per row (the rest is padding; kernels may skip it).
            records: which record type to build (``factor``, ``snapshot``, ``replay``).
            logits: whether to compute the LM head (prefill skips it).
            pending: a factor commit to apply first, layer by layer (the delayed commit; with
                ``kernels="triton"`` it is fused into the verify kernel).
        Returns:
            ``(logits [B, T, vocab] or None, hidden [B, T, hidden], records tuple)``.
        """
        mask = inclusive_ancestor_mask(parents)
        anc = conv_ancestors(parents, self.conv_width)
        x = self.embed_weight[tokens]
        B, T = tokens.shape
        st = self.state_dtype
        out_records: list[Record] = []
        kernel = self._use_kernel(records)
        choice = self._kernel_choice(pick_verify_kernel, parents, counts) if kernel else "reference"
        for li, L in enumerate(self.layers):
            prev = pending.records[li] if pending is not None else None
            if prev is not None:  # delayed commit of the previous step, conv window first
                commit_conv = conv_kernels.conv_commit if kernel else conv_window_after
                self.conv[li] = commit_conv(prev.conv_x, self.conv[li], pending.path, pending.path_len)
            if prev is not None and choice == "reference":
                if kernel:  # a tree too large for the parallel kernel: commit, then verify unfused
                    flush_commit(self.recurrent[li], prev.Bm, prev.u, prev.G, pending.path, pending.path_len)
                else:
                    self.recurrent[li] = ssd_commit_factor(self.recurrent[li], prev.Bm, prev.u, prev.G,
                                                           pending.path, pending.path_len)
            residual = x.float() if L.residual_fp32 else x
            h = rms_norm(x, L.norm, L.norm_eps)
            proj = F.linear(h, L.w_in, L.b_in)
            Di, Dc = L.H * L.P, L.conv_w.shape[0]
            z, xbc, dt_raw = proj.split([Di, Dc, L.H], dim=-1)
            xbc_in = xbc
            xbc = (conv_kernels.tree_conv if kernel else tree_conv)(xbc, self.conv[li], L.conv_w, L.conv_b, anc)
            xs, Bm, Cm = xbc.split([Di, L.G * L.N, L.G * L.N], dim=-1)
            xs = xs.reshape(B, T, L.H, L.P)
            Bm, Cm = Bm.reshape(B, T, L.G, L.N), Cm.reshape(B, T, L.G, L.N)
            dt, a = discretize(dt_raw, L.dt_bias, L.A_log, L.dt_limit)
            S0 = self.recurrent[li]
            fused = None if prev is None or choice == "reference" else (prev.Bm, prev.u, prev.G, pending.path,
                                                                        pending.path_len)
            if choice == "serial":  # the kernels apply the pending commit to S0 in place first
                y, u, G = serial_verify(xs, dt, a, Bm, Cm, L.D, S0, counts, pending=fused)
            elif choice == "parallel":
                y, u, G = tree_verify(xs, dt, a, Bm, Cm, L.D, S0, mask, pending=fused)
            else:
                y, u, G = tree_ssd(xs, dt, a, Bm, Cm, L.D, S0, mask)
            if records == "factor":
                out_records.append(Mamba2FactorRecord(Bm=Bm, u=u, G=G, conv_x=xbc_in))
            elif records == "snapshot":
                out_records.append(Mamba2SnapshotRecord(node_states(S0, Bm, u, G, mask),
                                                        conv_windows_per_node(xbc_in, self.conv[li], anc)))
            else:
                out_records.append(Mamba2ReplayRecord(Bm=Bm, u=u, a=a.to(st), conv_x=xbc_in))
            y = y.reshape(B, T, Di)
            if L.gnorm is not None:
                o = gated_rms_norm(y, z, L.gnorm, L.gnorm_eps, L.group_size, L.norm_before_gate)
            else:
                o = y * F.silu(z.to(st))
            x = (residual + F.linear(o.to(self.dtype), L.w_out, L.b_out)).to(self.dtype)
        out = self.lm_logits(x) if logits else None
        return out, x, tuple(out_records)

    def _apply(self, records: tuple[Record, ...], path: Tensor, path_len: Tensor) -> None:
        """Commit ``path`` (``[B, L]``, ``path_len [B]``) to every layer from its records."""
        end = path_end(path, path_len)
        rows = torch.arange(path.shape[0], device=path.device)
        for li, rec in enumerate(records):
            S0, win = self.recurrent[li], self.conv[li]
            if isinstance(rec, Mamba2SnapshotRecord):
                keep = path_len > 0
                picked = rec.states[rows, end.clamp(min=0)]
                self.recurrent[li] = torch.where(keep[:, None, None, None], picked, S0)
                self.conv[li] = torch.where(keep[:, None, None], rec.conv_windows[rows, end.clamp(min=0)], win)
                continue
            if isinstance(rec, Mamba2FactorRecord) and self._use_kernel("factor"):
                flush_commit(S0, rec.Bm, rec.u, rec.G, path, path_len)  # in place
                self.conv[li] = conv_kernels.conv_commit(rec.conv_x, win, path, path_len)
                continue
            if isinstance(rec, Mamba2FactorRecord):
                self.recurrent[li] = ssd_commit_factor(S0, rec.Bm, rec.u, rec.G, path, path_len)
            else:
                self.recurrent[li] = ssd_commit_replay(S0, rec.Bm, rec.u, rec.a, path, path_len)
            self.conv[li] = conv_window_after(rec.conv_x, win, path, path_len)
