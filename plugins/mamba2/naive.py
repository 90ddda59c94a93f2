"""Sequential pure-PyTorch references for Mamba2: explicit loops, one token at a time.

Executable documentation and the oracle every faster path (the batched reference in
``reference.py``) is tested against. Slow on purpose: each tree node is computed by walking its
own root path from the committed state, exactly as autoregressive decoding would. Formulas:
docs/DESIGN.md section 5 and the single-token decode branch of FLA's ``Mamba2.torch_forward``
(``fla/layers/mamba2.py``): ``h = exp(dt A) h + dt B x^T``, ``y = C^T h + D x``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from specla.ops.naive import naive_rms_norm, root_path


def ssd_step(S: Tensor, x: Tensor, dt: Tensor, A: Tensor, b: Tensor, c: Tensor, D: Tensor):
    """One Mamba2 (SSD) step for one head.

    Args:
        S: ``[N, P]`` state; x: ``[P]``; dt, A: scalars (0-dim, ``A < 0``); b, c: ``[N]``;
        D: scalar or ``[P]``.
    Returns:
        ``(S_new [N, P], y [P])``.
    """
    S = torch.exp(dt * A) * S + torch.outer(b, dt * x)
    return S, S.T @ c + D * x


def naive_tree_ssd(x, dt, A, Bm, Cm, D, S0, parents):
    """Per-path sequential SSD over a batch of trees.

    Args:
        x: ``[B, T, H, P]``; dt: ``[B, T, H]`` (after softplus/clamp); A: ``[H]`` (negative);
        Bm, Cm: ``[B, T, G, N]``; D: ``[H]`` or ``[H, P]``; S0: ``[B, H, N, P]``;
        parents: ``[B, T]`` int64 (``-1`` = child of the committed state).
    Returns:
        ``y [B, T, H, P]``, ``u [B, T, H, P]`` (``dt * x``), ``G [B, T, H]`` (log decay summed
        along the path), ``states [B, T, H, N, P]`` (state after each node), all in ``S0.dtype``.
    """
    B, T, H, P = x.shape
    grp = H // Bm.shape[2]
    ct = S0.dtype
    y, u = torch.zeros(B, T, H, P, dtype=ct, device=S0.device), torch.zeros(B, T, H, P, dtype=ct, device=S0.device)
    G = torch.zeros(B, T, H, dtype=ct, device=S0.device)
    states = torch.zeros(B, T, *S0.shape[1:], dtype=ct, device=S0.device)
    for b in range(B):
        par = parents[b].tolist()
        for i in range(T):
            for h in range(H):
                S, Gs = S0[b, h].clone(), torch.zeros((), dtype=ct, device=S0.device)
                for j in root_path(par, i):
                    S, out = ssd_step(S, x[b, j, h].to(ct), dt[b, j, h].to(ct), A[h].to(ct),
                                      Bm[b, j, h // grp].to(ct), Cm[b, j, h // grp].to(ct), D[h].to(ct))
                    Gs = Gs + dt[b, j, h].to(ct) * A[h].to(ct)
                y[b, i, h], G[b, i, h], states[b, i, h] = out, Gs, S
                u[b, i, h] = dt[b, i, h].to(ct) * x[b, i, h].to(ct)
    return y, u, G, states


def naive_gated_rms_norm(y: Tensor, z: Tensor, weight: Tensor, eps: float, group_size: int,
                         norm_before_gate: bool) -> Tensor:
    """FLA ``rms_norm_ref`` for one token: ``y, z [Di]``, group by group; float32/float64 result."""
    ct = torch.float64 if y.dtype == torch.float64 else torch.float32
    y, gate = y.to(ct), F.silu(z.to(ct))
    if not norm_before_gate:
        y = y * gate
    out = torch.cat([naive_rms_norm(y[s : s + group_size], weight[s : s + group_size], eps)
                     for s in range(0, y.shape[0], group_size)])
    return out * gate if norm_before_gate else out


class NaiveMamba2:
    """Plain autoregressive decoding of an FLA ``Mamba2ForCausalLM``, one token per step through
    every layer with the sequential recurrence (no trees, no factors, no batching).

    Reads the model's weights; its forward is not used. State: ``states[l]`` ``[H, N, P]``
    (float32, float64 for float64 models) and ``inputs[l]``, every pre-conv ``xBC`` projection so
    far (the conv window is its last ``C - 1`` rows).

    Args:
        model: the transformers/FLA model.
    """

    def __init__(self, model):
        self.model = model
        self.dt = model.lm_head.weight.dtype
        self.ct = torch.float64 if self.dt == torch.float64 else torch.float32
        mixers = [blk.mixer for blk in model.backbone.layers]
        self.states = [torch.zeros(m.num_heads, m.ssm_state_size, m.head_dim, dtype=self.ct) for m in mixers]
        self.inputs: list[list[Tensor]] = [[] for _ in mixers]

    def window(self, layer: int) -> Tensor:
        """``[C - 1, Dc]`` conv window of ``layer``: the last ``C - 1`` pre-conv inputs, zero-padded."""
        m = self.model.backbone.layers[layer].mixer
        C = m.conv_kernel_size
        hist = [torch.zeros(m.conv_dim, dtype=self.dt)] * (C - 1) + self.inputs[layer]
        return torch.stack(hist[len(hist) - (C - 1):]) if C > 1 else torch.zeros(0, m.conv_dim, dtype=self.dt)

    @torch.no_grad()
    def step(self, token: int) -> Tensor:
        """Feed one token; return the next-token logits ``[vocab]``."""
        bb, dt, ct = self.model.backbone, self.dt, self.ct
        x = bb.embeddings.weight[token]
        for li, blk in enumerate(bb.layers):
            m = blk.mixer
            residual = x.to(torch.float32) if blk.residual_in_fp32 else x
            h = naive_rms_norm(x, blk.norm.weight, blk.norm.eps).to(dt)
            proj = h @ m.in_proj.weight.T
            if m.in_proj.bias is not None:
                proj = proj + m.in_proj.bias
            Di, H, P, N = m.intermediate_size, m.num_heads, m.head_dim, m.ssm_state_size
            z, xbc, dt_raw = proj.split([Di, m.conv_dim, H])
            self.inputs[li].append(xbc)
            C = m.conv_kernel_size
            hist = ([torch.zeros_like(xbc)] * C + self.inputs[li])[-C:]
            pre = (torch.stack(hist).to(ct).T * m.conv1d.weight[:, 0].to(ct)).sum(-1)
            if m.conv1d.bias is not None:
                pre = pre + m.conv1d.bias.to(ct)
            xbc = F.silu(pre).to(dt)
            xs, b, c = xbc.split([Di, m.n_groups * N, m.n_groups * N])
            xs, b, c = xs.view(H, P).to(ct), b.view(m.n_groups, N).to(ct), c.view(m.n_groups, N).to(ct)
            step = F.softplus(dt_raw.to(ct) + m.dt_bias.to(ct)).clamp(m.dt_limit[0], m.dt_limit[1])
            A = -torch.exp(m.A_log.to(ct))
            D = m.D.to(ct).view(H, P) if m.D_has_hdim else m.D.to(ct)
            grp = H // m.n_groups
            y = torch.zeros(H, P, dtype=ct)
            for hd in range(H):
                self.states[li][hd], y[hd] = ssd_step(self.states[li][hd], xs[hd], step[hd], A[hd],
                                                      b[hd // grp], c[hd // grp], D[hd])
            y = y.reshape(-1)
            if m.rmsnorm:
                o = naive_gated_rms_norm(y, z, m.norm.weight, m.norm.eps, m.norm.group_size, m.norm_before_gate)
            else:
                o = y * F.silu(z.to(ct))
            o = o.to(dt) @ m.out_proj.weight.T
            if m.out_proj.bias is not None:
                o = o + m.out_proj.bias
            x = (residual + o).to(dt)
        return naive_rms_norm(x, bb.norm_f.weight, bb.norm_f.eps).to(dt) @ self.model.lm_head.weight.T


def naive_greedy_decode(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy autoregressive decoding with :class:`NaiveMamba2`; returns the new tokens only."""
    dec = NaiveMamba2(model)
    for tok in prompt[:-1]:
        dec.step(tok)
    out, tok = [], prompt[-1]
    while len(out) < max_new_tokens:
        tok = int(dec.step(tok).argmax())
        out.append(tok)
    return out
