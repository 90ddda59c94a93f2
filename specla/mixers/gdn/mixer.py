"""Gated DeltaNet as a sequence mixer (:class:`specla.mixers.Mixer`): what every GDN layer runs,
FLA's (the gdn plugin) and the hybrids' (Qwen3.5, Qwen3-Next), with its records, reference path
and Triton kernels (this package's ``records``, ``reference``, ``verify`` and ``commit``).

Shapes: ``B`` sequences, ``T`` verified nodes (root explicit), ``H`` key heads, ``HV`` value heads
(a multiple of ``H``; value head ``j`` reads key head ``j // (HV / H)``, FLA's and transformers'
grouping), ``K``/``V`` head dims, ``Dc = 2 H K + HV V`` conv channels, ``C`` conv width.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from specla.baselines import ReplayRecord
from specla.mixers import RecurrentMixer, TreePass
from specla.ops import fla_installed, kernels
from specla.ops.act import decay_and_sigmoid_gates
from specla.ops.conv import causal_conv, tree_conv
from specla.ops.norm import l2norm
from specla.records import LayerCommit, Record

from .records import GDNFactorRecord
from .reference import chunk_gdn, gdn_commit_factor, gdn_commit_replay, node_states, tree_gdn

act_kernels = kernels("specla.ops.act_triton")
conv_kernels = kernels("specla.ops.conv_triton")
norm_kernels = kernels("specla.ops.norm_triton")
verify_kernels = kernels("specla.mixers.gdn.verify")
commit_kernels = kernels("specla.mixers.gdn.commit")


def kernel_plan(tp_choose: Callable, parents: Tensor, counts: Tensor):
    """The verify kernel of a pass (``tp_choose(verify_kernels.pick_verify_kernel)``: the adapter's rule, which
    takes ``parallel`` or ``serial`` while a CUDA graph records) and the hybrid kernel's launch
    plan when that is the choice: decided once per pass, shared by every layer."""
    choice = tp_choose(verify_kernels.pick_verify_kernel)
    return choice, (verify_kernels.hybrid_plan(parents) if choice == "hybrid" else None)


def run_verify_kernel(plan, q, k, v, g, beta, S0, parents, counts, mask, scale, pending):
    """Run the chosen verify kernel (``plan`` from :func:`kernel_plan`) with the pending factor
    commit (a :class:`specla.records.LayerCommit`, or ``None``) fused. Returns ``o, delta, G``."""
    choice, hplan = plan
    if choice == "serial":
        return verify_kernels.serial_verify(q, k, v, g, beta, S0, counts, scale, pending=pending)
    if choice == "parallel":
        return verify_kernels.tree_verify(q, k, v, g, beta, S0, mask, scale, pending=pending)
    if pending is not None and hplan.waves and hplan.waves[0][0].shape[0] != parents.shape[0]:
        commit_kernels.flush_commit(S0, pending)  # not root-explicit: commit first, then verify unfused
        pending = None
    return verify_kernels.hybrid_verify(q, k, v, g, beta, S0, parents, scale, pending=pending, plan=hplan)


def apply_pending(S: Tensor, prev: GDNFactorRecord, path: Tensor, path_len: Tensor, kernel: bool) -> Tensor:
    """One layer's recurrent state after a pending factor commit, applied at the start of the
    next verify: on the reference path only (the verify kernels apply it fused)."""
    return S if kernel else gdn_commit_factor(S, prev.k, prev.delta, prev.G, path, path_len)


def _reference_recurrence(q, k, v, g, beta, S0, mask, scale, records):
    """:func:`reference.tree_gdn` (the pass's record kind does not change it)."""
    return tree_gdn(q, k, v, g, beta, S0, mask, scale)


class GDNMixer(RecurrentMixer):
    """One Gated DeltaNet layer's sequence mixer (Yang et al. 2024, arXiv 2412.06464): input
    projections, tree-aware short convolution + SiLU, L2-normalised q/k, gates ``g = -exp(A_log)
    softplus(a + dt_bias)`` and ``beta = beta_scale * sigmoid(b)``, the tree-masked delta rule
    with records of the pass's kind (docs/DESIGN.md section 4), then ``output(o, z, kernels)``.

    State: ``S [B, HV, K, V]`` in ``state_dtype`` (float32, or float64 for float64 runs) and the
    conv window ``[B, C - 1, Dc]`` in the activation dtype.

    Args:
        project: ``(h [B, T, hidden], kernels) -> (qkv [B, T, Dc], a [B, T, HV], b [B, T, HV], z
            [B, T, HV V] or None)``: the layer's input projections (the model's own modules),
            ``qkv`` with q's ``H`` heads, then k's, then v's ``HV`` heads, before the short conv;
            ``kernels``: the pass runs the Triton kernels (a plugin may fuse its GEMMs then).
        conv_w: ``[Dc, C]`` depthwise taps, or ``None`` (no short conv: SiLU alone).
        conv_b: ``[Dc]`` or ``None``. A_log, dt_bias: ``[HV]`` in ``state_dtype``.
        H, HV, K, V: head counts and dims. beta_scale: 2 with negative eigenvalues, else 1.
        output: ``(o [B, T, HV, V], z [B, T, HV V] or None, kernels) -> [B, T, ...]``: the gated
            norm and output projection (the model's own modules); ``o`` is in the activation
            dtype from the kernels, in ``state_dtype`` from the reference path.
        dtype, state_dtype, device: activations, recurrent state, device.

    Attributes:
        recurrence: ``(q, k, v, g, beta, S0, mask, scale, records) -> (o, delta, G)``, the
            reference path's recurrence over the tree (:func:`reference.tree_gdn`); a baseline may
            swap it (``benchmarks/e2e.py``'s FLA-SD row; ``delta`` and ``G`` may then be ``None``,
            which only replay records allow).
        replay_commit: ``(S0, k, v, g, beta, path, path_len) -> S``, the ``replay`` baseline's
            commit (:func:`reference.gdn_commit_replay`), swappable likewise.
    """

    baselines = frozenset({"snapshot", "replay"})
    replay_commit = staticmethod(gdn_commit_replay)  # a replay record's inputs: k, v, g, beta

    # the default prefill takes the passes in half precision: side by side with the chain passes on
    # the trained `small` target (BENCHMARKS.md section 4) and GPU-tested in bfloat16
    prefill_by_default = True

    def __init__(self, *, project: Callable[..., tuple], conv_w: Tensor | None, conv_b: Tensor | None,
                 A_log: Tensor, dt_bias: Tensor, H: int, HV: int, K: int, V: int, beta_scale: float,
                 output: Callable[..., Tensor], dtype: torch.dtype, state_dtype: torch.dtype, device: torch.device):
        self.project = project
        self.conv_w, self.conv_b = conv_w, conv_b
        self.dt_bias, self.neg_A = dt_bias, -torch.exp(A_log)
        self.H, self.HV, self.K, self.V, self.beta_scale = H, HV, K, V, beta_scale
        self.output = output
        self.dtype, self.state_dtype, self.device = dtype, state_dtype, device
        self.C = conv_w.shape[1] if conv_w is not None else 0
        self.Dc = 2 * H * K + HV * V
        self.recurrence = _reference_recurrence
        self.empty_state(0, 0)

    def empty_record(self, B: int, T: int) -> GDNFactorRecord:
        z = lambda *s, dtype=self.state_dtype: torch.zeros(B, T, *s, dtype=dtype, device=self.device)  # noqa: E731
        return GDNFactorRecord(k=z(self.H, self.K), delta=z(self.HV, self.V), G=z(self.HV),
                               conv_x=z(self.Dc, dtype=self.dtype) if self.C else None)

    def empty_state(self, B: int, capacity: int) -> None:
        self.S = torch.zeros(B, self.HV, self.K, self.V, dtype=self.state_dtype, device=self.device)
        self.conv = torch.zeros(B, self.C - 1, self.Dc, dtype=self.dtype, device=self.device) if self.C else None

    def inputs(self, qkv: Tensor, a: Tensor, b: Tensor, kernel: bool):
        """``q, k [B, T, H, K]`` (L2-normalised), ``v [B, T, HV, V]`` and the gates ``g, beta
        [B, T, HV]`` (state dtype) from the conv output ``qkv`` and the gate projections; with
        ``kernel`` both norms and both gates are one Triton launch each (same formulas)."""
        B, T = qkv.shape[:2]
        H, HV, K, V = self.H, self.HV, self.K, self.V
        if kernel:
            q, k = norm_kernels.l2norm_pair(qkv, H, K)
            g, beta = act_kernels.decay_and_sigmoid_gates(a, b, self.dt_bias, self.neg_A, self.beta_scale)
        else:
            q = l2norm(qkv[..., : H * K].reshape(B, T, H, K))
            k = l2norm(qkv[..., H * K : 2 * H * K].reshape(B, T, H, K))
            g, beta = decay_and_sigmoid_gates(a, b, self.dt_bias, self.neg_A, self.beta_scale, self.state_dtype)
        return q, k, qkv[..., 2 * H * K :].reshape(B, T, HV, V), g, beta

    def verify(self, h: Tensor, tp: TreePass, pending: LayerCommit | None) -> tuple[Tensor, Record]:
        kernel = tp.kernels
        if pending is not None:
            prev, path, path_len = pending
            self.commit_window(prev.conv_x, path, path_len, kernel)
            self.S = apply_pending(self.S, prev, path, path_len, kernel)
        proj, a, b, z = self.project(h, kernel)
        anc = tp.conv_ancestors(self.C) if self.C else None
        if anc is not None:
            qkv = (conv_kernels.tree_conv if kernel else tree_conv)(proj, self.conv, self.conv_w, self.conv_b, anc)
        else:
            qkv = F.silu(proj)
        q, k, v, g, beta = self.inputs(qkv, a, b, kernel)
        if kernel:  # fused: the kernel applies the pending commit to S in place, then verifies
            plan = tp.shared("gdn-kernel", lambda: kernel_plan(tp.choose, tp.parents, tp.counts))
            o, delta, G = run_verify_kernel(plan, q, k, v, g, beta, self.S, tp.parents, tp.counts, tp.mask,
                                            self.K**-0.5, pending)
        else:
            o, delta, G = self.recurrence(q, k, v, g, beta, self.S, tp.mask, self.K**-0.5, tp.records)
        conv_x = proj if anc is not None else None
        if tp.records == "replay":
            rec = ReplayRecord((k, v.to(self.state_dtype), g, beta), conv_x)
        else:
            rec = GDNFactorRecord(k=k, delta=delta, G=G, conv_x=conv_x)
        return self.output(o, z, kernel), rec

    def node_states(self, record: GDNFactorRecord, tp: TreePass) -> list[Tensor]:
        return [node_states(self.S, record.k, record.delta, record.G, tp.mask),
                *self.window_states(record.conv_x, tp)]

    def prefills_whole(self, kernels: bool) -> bool:
        # FLA's chunk kernels autotune, which needs a GPU driver (Triton's CPU interpreter has none)
        return kernels and self.device.type == "cuda" and fla_installed()

    def prefill(self, h: Tensor, tp: TreePass) -> Tensor:
        """Whole prompts (:meth:`specla.mixers.Mixer.prefill`) on the kernel path: the tree
        short-conv kernel along the chain and its window commit at ``tp.counts``, then FLA's
        chunked gated delta rule (``chunk_gated_delta_rule``, the same recurrence in its WY form,
        64-token chunks) from the state the layer holds (empty at a prompt's start) to the state after
        each row's tokens. Padding rows
        get ``g = 0`` and ``beta = 0``, which leave the state as it is (the delta rule's update
        is ``S <- exp(g) S + beta k (v - S^T k)^T``), so one right-padded batch serves ragged
        prompts."""
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        proj, a, b, z = self.project(h, True)
        path, pad = tp.chain()
        if self.C:
            qkv = conv_kernels.tree_conv(proj, self.conv, self.conv_w, self.conv_b, tp.conv_ancestors(self.C))
            self.commit_window(proj, path, tp.counts, True)
        else:
            qkv = F.silu(proj)
        q, k, v, g, beta = self.inputs(qkv, a, b, True)
        g, beta = g.masked_fill(pad[..., None], 0.0), beta.masked_fill(pad[..., None], 0.0)
        # FLA's kernels multiply k, v and beta in one dtype (its own layer's: the activations')
        q, k, beta = q.to(v.dtype), k.to(v.dtype), beta.to(v.dtype)
        o, S = chunk_gated_delta_rule(q, k, v, g, beta, scale=self.K**-0.5, initial_state=self.S,
                                      output_final_state=True)
        self.S = S.to(self.state_dtype)
        return self.output(o, z, True)

    def sequence(self, h: Tensor, chunk: int) -> Tensor:
        """The layer over whole sequences ``h [B, T, hidden]`` from an empty state, teacher-forced
        (scoring and training): causal short conv and the chunked gated delta rule
        (:func:`reference.chunk_gdn`, ``chunk`` tokens per chunk) on the reference path,
        differentiable. Returns ``output(o, z, False)``; the state is not touched."""
        proj, a, b, z = self.project(h, False)
        qkv = causal_conv(proj, self.conv_w, self.conv_b) if self.C else F.silu(proj)
        q, k, v, g, beta = self.inputs(qkv, a, b, False)
        S0 = torch.zeros(h.shape[0], self.HV, self.K, self.V, dtype=self.state_dtype, device=h.device)
        o, _ = chunk_gdn(q, k, v, g, beta, S0, self.K**-0.5, chunk)
        return self.output(o, z, False)

    def commit(self, pending: LayerCommit, kernels: bool) -> None:
        record, path, path_len = pending
        if kernels:
            commit_kernels.flush_commit(self.S, pending)  # in place
        else:
            self.S = gdn_commit_factor(self.S, record.k, record.delta, record.G, path, path_len)
        self.commit_window(record.conv_x, path, path_len, False)
