"""specla's GDN tree verify and commit on SGLang's data: its state pool by slot index, its packed
draft tokens, its raw gates and its ``retrieve_parent_token``, with factor records
(:mod:`specla_sglang.records`) in the pool's per-node buffer instead of per-node states.

Shapes as SGLang passes them: ``bs`` requests of ``D`` draft tokens each (``N = bs * D`` packed
tokens; node 0 of each request is its last committed token), ``H`` key heads, ``HV`` value heads,
``K``/``V`` head dims; SGLang's states are ``[HV, V, K]`` (V before K), specla's ``[HV, K, V]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from sglang.srt.layers.attention.linear.kernels.kernel_backend import LinearAttnKernelBase
from specla.mixers.gdn.commit import flush_commit
from specla.mixers.gdn.verify import tree_verify
from specla.tree import inclusive_ancestor_mask

from .records import RecordLayout

# SGLang's in-kernel q/k normalisation and gate (fused_sigmoid_gating_delta_rule_update)
_L2_EPS = 1e-6
_SOFTPLUS_THRESHOLD = 20.0


def is_record_buffer(buffer: Tensor | None, per_layer: bool) -> bool:
    """Whether SGLang's ``intermediate_ssm`` holds this plugin's records (``[layers, rows, D, W]``,
    or ``[rows, D, W]`` for one layer) rather than its per-node states (two dimensions more)."""
    return buffer is not None and buffer.dim() == (3 if per_layer else 4)


def _l2norm(x: Tensor) -> Tensor:
    x = x.float()
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + _L2_EPS)


def tree_parents(retrieve_parent_token: Tensor | None, bs: int, D: int, device) -> Tensor:
    """``[bs, D]`` int64 parents with node 0 as the root (SGLang leaves its entry 0 unset); a chain
    (node ``t`` the child of ``t - 1``) without ``retrieve_parent_token``."""
    if retrieve_parent_token is None:
        return torch.arange(-1, D - 1, device=device).expand(bs, D)
    parents = retrieve_parent_token[:bs, :D].to(torch.int64).clone()
    parents[:, 0] = -1
    return parents


def verify_tree(
    A_log: Tensor, dt_bias: Tensor, q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, *,
    ssm_states: Tensor, cache_indices: Tensor, query_start_loc: Tensor, records: Tensor,
    record_rows: Tensor, retrieve_parent_token: Tensor,
) -> Tensor:
    """One GDN layer's tree verify: outputs of every node as if its root path had been decoded
    serially from the request's state, and its factor records written to ``records``.

    Args:
        A_log, dt_bias: ``[HV]``; the gate is ``g = -exp(A_log) softplus(a + dt_bias)``, ``beta =
            sigmoid(b)`` (SGLang's).
        q, k: ``[N, H, K]`` or ``[1, N, H, K]``, any strides, before L2 normalisation.
        v: ``[N, HV, V]`` or ``[1, N, HV, V]``; a, b: ``[N, HV]``.
        ssm_states: ``[slots, HV, V, K]`` float32, read only (slot ``cache_indices[i]``; a negative
            index is a padding request, verified from a zero state).
        cache_indices: ``[>= bs]`` int; query_start_loc: ``[bs + 1]`` int32 (its length gives ``bs``).
        records: ``[rows, D, W]`` float32, this layer's record buffer (:mod:`specla_sglang.records`);
            row ``record_rows[i]`` of request ``i`` is written.
        record_rows: ``[>= bs]`` int; retrieve_parent_token: ``[bs, D]`` int (entry 0 unused), or
            ``None`` for chains.
    Returns:
        ``[1, N, HV, V]`` (``v``'s shape), ``v.dtype``.
    Raises:
        NotImplementedError: requests of different draft lengths (a ragged verify layout).
    """
    bs = query_start_loc.shape[0] - 1
    HV, V = v.shape[-2:]
    H, K = k.shape[-2:]
    N = v.numel() // (HV * V)
    if N % bs:
        raise NotImplementedError(f"{N} draft tokens over {bs} requests: ragged tree verify is not supported")
    D = N // bs
    qh, kh = (_l2norm(x.reshape(bs, D, H, K)) for x in (q, k))
    vh = v.reshape(bs, D, HV, V)
    x = a.reshape(bs, D, HV).float() + dt_bias.float()
    g = -torch.exp(A_log.float()) * F.softplus(x, beta=1.0, threshold=_SOFTPLUS_THRESHOLD)
    beta = torch.sigmoid(b.reshape(bs, D, HV).float())
    slots = cache_indices[:bs].to(torch.int64)
    S0 = ssm_states[slots.clamp(min=0)].float() * (slots >= 0).view(-1, 1, 1, 1)
    parents = tree_parents(retrieve_parent_token, bs, D, v.device)
    o, delta, G = tree_verify(qh, kh, vh, g, beta, S0.transpose(-1, -2).contiguous(), inclusive_ancestor_mask(parents),
                              scale=K ** -0.5)
    rows = record_rows[:bs].to(torch.int64)
    for block, x in zip(RecordLayout(H=H, HV=HV, K=K, V=V).views(records), (kh, delta, G, parents)):
        block[rows, :D] = x.to(block.dtype)
    return o.reshape(1, N, HV, V)


def commit_paths(
    temporal: Tensor, records: Tensor, base: Tensor, dst: Tensor, steps: Tensor, src_rows: Tensor | None,
) -> None:
    """Commit, in every layer, the root path of node ``steps[i]`` of request ``i``, applied to the
    state in slot ``base[i]`` (the one the tree was verified from), into slot ``dst[i]``, from the
    records alone (closed form, docs/DESIGN.md section 4).

    Args:
        temporal: ``[layers, slots, HV, V, K]`` SGLang's state pool, updated in place.
        records: ``[layers, rows, D, W]`` float32 (:mod:`specla_sglang.records`).
        base, dst: ``[>= bs]`` int slots; steps: ``[bs]`` int node of the last token to commit; a
            negative slot or node leaves that request's states untouched.
        src_rows: ``[>= bs]`` int record row of each request; ``None``: row ``i`` for request ``i``.
    """
    bs = steps.shape[0]
    device = temporal.device
    src = torch.arange(bs, device=device) if src_rows is None else src_rows[:bs].to(torch.int64)
    valid = ((steps >= 0) & (base[:bs] >= 0) & (dst[:bs] >= 0)).nonzero().squeeze(1)
    if valid.numel() == 0:
        return
    src, steps = src[valid], steps[valid].to(torch.int64)
    base, dst = (x[:bs][valid].to(torch.int64) for x in (base, dst))
    layout = RecordLayout.of_buffer(temporal.shape, records.shape[-1])
    D = records.shape[2]
    parents = layout.views(records[0])[3][src].to(torch.int64)  # [n, D]: the same in every layer
    on_path = inclusive_ancestor_mask(parents)[torch.arange(valid.numel(), device=device), steps]  # [n, D]
    # parents precede children, so the ancestors in index order run root to leaf
    order = torch.where(on_path, torch.arange(D, device=device), D).sort(-1).values
    path = torch.where(order < D, order, -1)
    path_len = on_path.sum(-1)
    for layer in range(temporal.shape[0]):
        k, delta, G, _ = (x[src] for x in layout.views(records[layer]))
        S = temporal[layer, base].float().transpose(-1, -2).contiguous()
        flush_commit(S, k, delta, G, path, path_len)
        temporal[layer, dst] = S.transpose(-1, -2).to(temporal.dtype)


class SpeclaGDNVerifyKernel(LinearAttnKernelBase):
    """A verify slot of SGLang's ``GDNKernelDispatcher`` (``tree_verify_kernel``, ``verify_kernel``):
    specla's verify where the pool holds factor records (trees, and the chains of SGLang's dummy
    runs, which come without ``retrieve_parent_token``), the kernel it replaces where the pool
    holds per-node states (a pool this plugin did not build). Decode and extend stay that kernel's.

    Args:
        sglang_kernel: the ``LinearAttnKernelBase`` SGLang put in the slot.
    """

    def __init__(self, sglang_kernel: LinearAttnKernelBase):
        self.sglang_kernel = sglang_kernel
        self.supports_strided_target_verify_qkv = sglang_kernel.supports_strided_target_verify_qkv

    def decode(self, *args, **kwargs):
        return self.sglang_kernel.decode(*args, **kwargs)

    def extend(self, *args, **kwargs):
        return self.sglang_kernel.extend(*args, **kwargs)

    def target_verify(self, A_log, dt_bias, q, k, v, a, b, *, ssm_states, cache_indices, query_start_loc,
                      intermediate_states_buffer, intermediate_state_indices, cache_steps,
                      retrieve_parent_token=None, **kwargs) -> Tensor:
        """``LinearAttnKernelBase.target_verify``: see :func:`verify_tree` (``intermediate_states_buffer``
        is ``records``, ``intermediate_state_indices`` is ``record_rows``)."""
        if not is_record_buffer(intermediate_states_buffer, per_layer=True):
            return self.sglang_kernel.target_verify(
                A_log, dt_bias, q, k, v, a, b, ssm_states=ssm_states, cache_indices=cache_indices,
                query_start_loc=query_start_loc, intermediate_states_buffer=intermediate_states_buffer,
                intermediate_state_indices=intermediate_state_indices, cache_steps=cache_steps,
                retrieve_parent_token=retrieve_parent_token, **kwargs)
        return verify_tree(A_log, dt_bias, q, k, v, a, b, ssm_states=ssm_states, cache_indices=cache_indices,
                           query_start_loc=query_start_loc, records=intermediate_states_buffer,
                           record_rows=intermediate_state_indices, retrieve_parent_token=retrieve_parent_token)
