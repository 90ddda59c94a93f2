"""specla's GDN layer in vLLM: a subclass of vLLM 0.34.0's ``QwenGatedDeltaNetAttention`` whose
speculative (chain) path keeps each request's recurrent state in one slot and verifies chains with
specla's ``gdn_pool_verify``, committing the accepted prefix with ``gdn_pool_commit``.

Names: ``N`` rows (requests) of a step, ``HV`` value heads and ``H`` key heads of this rank, ``K``/``V``
head dims, ``D = num_speculative_tokens + 1`` tokens a chain at most, ``slots`` the state slots of
vLLM's pool (``kv_cache[1]``: ``[slots, HV, V, K]`` float32).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import NamedTuple

import torch
from torch import Tensor
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_update
from vllm.v1.attention.backends.gdn_attn import (GDNAttentionBackend, GDNAttentionMetadata,
                                                 GDNAttentionMetadataBuilder)
from vllm.v1.kv_cache_interface import MambaSpec

from specla.mixers.gdn.serving import GDNRecordBuffers, empty_record_buffers, gdn_pool_commit, gdn_pool_verify


@dataclass
class SpeclaGDNAttentionMetadata(GDNAttentionMetadata):
    """vLLM's GDN metadata plus what vLLM's builder drops and the commit of a non-speculative row
    needs: ``non_spec_num_accepted_tokens`` ``[rows of non_spec_state_indices_tensor]`` int32, the
    tokens each of those rows accepted at its previous step (vLLM's ``num_accepted_tokens``, 1 after
    a prefill or a plain decode), or ``None`` where the step has no such rows or vLLM gave the builder
    no ``num_accepted_tokens`` (no speculative config)."""

    non_spec_num_accepted_tokens: Tensor | None = None


class SpeclaGDNAttentionMetadataBuilder(GDNAttentionMetadataBuilder):
    """vLLM's GDN metadata builder, its metadata extended to :class:`SpeclaGDNAttentionMetadata`."""

    def build(self, common_prefix_len, common_attn_metadata, num_accepted_tokens=None,  # type: ignore[override]
              num_decode_draft_tokens_cpu=None, fast_build=False) -> SpeclaGDNAttentionMetadata:
        m = super().build(common_prefix_len, common_attn_metadata, num_accepted_tokens, num_decode_draft_tokens_cpu,
                          fast_build)
        accepted = None
        if num_accepted_tokens is not None and m.non_spec_state_indices_tensor is not None:
            accepted = num_accepted_tokens[: common_attn_metadata.num_reqs]
            if m.spec_sequence_masks_cpu is not None:
                accepted = accepted[~m.spec_sequence_masks_cpu]
        return SpeclaGDNAttentionMetadata(**{f.name: getattr(m, f.name) for f in fields(m)},
                                          non_spec_num_accepted_tokens=accepted)


class SpeclaGDNAttentionBackend(GDNAttentionBackend):
    """vLLM's GDN attention backend (same name) building :class:`SpeclaGDNAttentionMetadata`."""

    @staticmethod
    def get_builder_cls() -> type[SpeclaGDNAttentionMetadataBuilder]:
        return SpeclaGDNAttentionMetadataBuilder


class SlotRecords(NamedTuple):
    """One layer's pending chains, one row per state slot of vLLM's pool (row ``s`` belongs to
    whatever request holds slot ``s``)."""

    records: GDNRecordBuffers  # [slots, D, ...] factor records of the slot's last verified chain
    pending: Tensor  # [slots] int32: tokens of that chain not yet committed (0: the slot is final)


class SpeclaQwenGatedDeltaNetAttention(QwenGatedDeltaNetAttention):
    """vLLM's Qwen GDN layer (Qwen3-Next, Qwen3.5), built by vLLM in its place once
    :func:`specla_vllm.register` has run: same constructor, parameters, weight loading, state shape
    (``get_state_shape``) and non-speculative forward, all vLLM's.

    Its speculative rows differ where :attr:`runs_specla_chains`: request ``n``'s recurrent state
    stays in one slot, ``s = spec_state_indices_tensor[n, 0]``, and vLLM's pool is charged that one
    slot a request (:meth:`get_kv_cache_spec`), not vLLM's ``1 + num_spec``. ``gdn_pool_verify``
    reads slot ``s`` and writes the chain's factor records into row ``s`` of :attr:`slot_records`,
    marking ``pending[s]`` with the chain's length; at the request's next step, speculative or not,
    :meth:`commit_pending` folds the first ``num_accepted_tokens`` of them into slot ``s`` before
    anything reads it. The conv window is vLLM's (``causal_conv1d_update`` with
    ``num_accepted_tokens``, in slot ``s``).

    vLLM's fused CUDA MTP decode kernel (per-position slots) is never taken.

    Raises:
        ValueError: (construction) prefix caching of Mamba states (``mamba_cache_mode="align"``)
            where :attr:`runs_specla_chains`: vLLM's block copies read its per-position slots.
    """

    slot_records: SlotRecords | None = None

    def __init__(self, config, vllm_config, prefix: str = "", **kwargs) -> None:
        super().__init__(config, vllm_config, prefix, **kwargs)
        if self.runs_specla_chains and vllm_config.cache_config.mamba_cache_mode == "align":
            raise ValueError("specla-vllm's GDN layer does not support mamba_cache_mode='align' with speculative "
                             "decoding: its prefix-cache block copies read vLLM's per-position state slots")
        self.enable_fused_gdn_spec_decode = False

    @property
    def runs_specla_chains(self) -> bool:
        """Whether this layer's chains go through specla: with speculative decoding, where the
        layer's forward reaches ``_forward_core`` (CUDA, ROCm, XPU's Triton backend); vLLM's CPU op
        and XPU's SYCL op keep vLLM's own per-position slots."""
        return bool(self.num_spec) and self._forward_method != self.forward_cpu and self.gdn_xpu_backend != "sycl"

    def get_attn_backend(self) -> type[SpeclaGDNAttentionBackend]:
        return SpeclaGDNAttentionBackend

    def get_kv_cache_spec(self, vllm_config):
        """vLLM's spec, charged one state block a request where :attr:`runs_specla_chains`
        (``num_speculative_blocks = 0``, as vLLM charges its ReplaySSM layers): vLLM's block manager
        allocates one block a request instead of ``1 + num_spec``, and the blocks freed hold other
        requests' states."""
        spec = super().get_kv_cache_spec(vllm_config)
        if self.runs_specla_chains and isinstance(spec, MambaSpec):
            return replace(spec, num_speculative_blocks=0)
        return spec

    def bind_kv_cache(self, kv_cache: Tensor) -> None:
        """vLLM's binding of the layer's pages, then, where :attr:`runs_specla_chains`,
        :attr:`slot_records` for every slot of the pool (allocated once, here, so CUDA graphs see
        fixed buffers; outside vLLM's memory budget: ``D * (H K + HV V + HV)`` float32 a slot).

        The records are shared by the layers whose state views vLLM lays over the same memory (one
        layer of each cache group, ``KVCacheTensor.shared_by``): their states share each slot, so a
        block belongs to one of them at a time, and row ``s`` of the records is only ever that
        layer's. Views of one allocation at other offsets or strides (layouts packing several
        layers of a group into one tensor) each get their own. A chain left
        pending by a finished request is committed into its freed block by the block's next owner
        at its first step, a prefill that does not read the block's state (prefix caching of Mamba
        states, which would, is refused at construction), and marked final there."""
        super().bind_kv_cache(kv_cache)
        if self.runs_specla_chains:
            ssm = self.kv_cache[1]
            HV, V, K = ssm.shape[1:]
            H, D = self.num_k_heads // self.tp_size, self.num_spec + 1
            # the allocation (one Python object however viewed) holds the records of each view of it
            by_view = ssm.untyped_storage().__dict__.setdefault("_specla_slot_records", {})
            view = (ssm.storage_offset(), ssm.shape, ssm.stride(), D, H)
            if view not in by_view:
                by_view[view] = SlotRecords(empty_record_buffers(ssm.shape[0], D, H, HV, K, V, ssm.device),
                                            torch.zeros(ssm.shape[0], dtype=torch.int32, device=ssm.device))
            self.slot_records = by_view[view]

    def commit_pending(self, slots: Tensor, num_accepted_tokens: Tensor) -> None:
        """Fold the pending chain of each slot in ``slots`` into it, its first
        ``min(num_accepted_tokens, pending)`` tokens, and mark the slots final (``pending = 0``).

        Args:
            slots: ``[R]`` int32/int64 state slots, each at most once; ``<= 0`` (vLLM's null block,
                padding) is skipped.
            num_accepted_tokens: ``[R]`` int32/int64 tokens each slot's request accepted at the step
                that verified its chain (vLLM's ``num_accepted_tokens``).
        Raises:
            ValueError: from ``gdn_pool_commit``, where shapes, dtypes or devices disagree.
        """
        if not slots.numel():
            return
        records, pending = self.slot_records
        D = records.k.shape[1]
        live = slots > 0
        rows = torch.where(live, slots, -1)
        at = slots.clamp(min=0).long()
        lens = torch.where(live, torch.minimum(num_accepted_tokens.to(pending.dtype), pending[at]), 0)
        R = slots.shape[0]
        positions = torch.arange(R * D, device=slots.device).view(R, D)
        gdn_pool_commit(self.kv_cache[1], rows, records, rows, positions, lens, D)
        pending.index_fill_(0, at, 0)

    def _metadata(self) -> GDNAttentionMetadata | None:
        """This layer's metadata of the current forward, as vLLM's ``_forward_core`` finds it."""
        attn_metadata = get_forward_context().attn_metadata
        return attn_metadata.get(self.prefix) if isinstance(attn_metadata, dict) else None

    def _commit_batch(self, m: GDNAttentionMetadata) -> None:
        """:meth:`commit_pending` for every row of the step, speculative or not.

        Raises:
            ValueError: the step has non-speculative rows and ``m`` no
                ``non_spec_num_accepted_tokens`` (vLLM's own metadata, or a builder given no
                ``num_accepted_tokens``): their pending chains could not be committed.
        """
        slots, accepted = [], []
        if m.spec_sequence_masks is not None:
            n = m.num_spec_decodes
            slots.append(m.spec_state_indices_tensor[:n, 0])
            accepted.append(m.num_accepted_tokens[:n])
        if m.non_spec_state_indices_tensor is not None:
            rows = m.non_spec_state_indices_tensor
            given = getattr(m, "non_spec_num_accepted_tokens", None)
            if given is None:
                raise ValueError("a step with non-speculative rows needs SpeclaGDNAttentionMetadata."
                                 "non_spec_num_accepted_tokens (vLLM gave no num_accepted_tokens to the builder)")
            slots.append(rows)
            accepted.append(given)
        if slots:
            self.commit_pending(torch.cat(slots), torch.cat(accepted))

    def _forward_core(self, mixed_qkv: Tensor, b: Tensor, a: Tensor, core_attn_out: Tensor):
        """vLLM's ``_forward_core`` (packed ``mixed_qkv [tokens, 2 H K + HV V]``, gates ``b, a
        [tokens, HV]``, ``core_attn_out [tokens, HV, V]`` written), with the pending chains of the
        step's rows committed first and the speculative rows run by :meth:`_forward_spec`; the other
        rows of a mixed step run vLLM's own path on their part of the batch."""
        m = self._metadata()
        if m is None or self.slot_records is None:  # vLLM's profiling run; no speculative config
            return super()._forward_core(mixed_qkv, b, a, core_attn_out)
        self._commit_batch(m)
        if m.spec_sequence_masks is None:
            return super()._forward_core(mixed_qkv, b, a, core_attn_out)
        mixed_qkv, b, a = mixed_qkv[: m.num_actual_tokens], b[: m.num_actual_tokens], a[: m.num_actual_tokens]
        if m.num_prefills == 0 and m.num_decodes == 0:
            self._forward_spec(m, mixed_qkv, b, a, core_attn_out[: m.num_actual_tokens])
            return
        # vLLM counts a step's non-speculative one-token rows as prefills when it has speculative rows
        rest = m.non_spec_token_indx
        out = core_attn_out.new_empty(rest.shape[0], *core_attn_out.shape[1:])
        alone = replace(m, spec_sequence_masks=None, spec_sequence_masks_cpu=None, spec_state_indices_tensor=None,
                        spec_query_start_loc=None, spec_token_indx=None, non_spec_token_indx=None, num_spec_decodes=0,
                        num_spec_decode_tokens=0, num_accepted_tokens=None, num_actual_tokens=rest.shape[0])
        entries = get_forward_context().attn_metadata
        entries[self.prefix] = alone
        try:
            super()._forward_core(mixed_qkv.index_select(0, rest), b.index_select(0, rest), a.index_select(0, rest), out)
        finally:
            entries[self.prefix] = m
        core_attn_out.index_copy_(0, rest, out)
        spec = m.spec_token_indx
        spec_out = core_attn_out.new_empty(spec.shape[0], *core_attn_out.shape[1:])
        self._forward_spec(m, mixed_qkv.index_select(0, spec), b.index_select(0, spec), a.index_select(0, spec), spec_out)
        core_attn_out.index_copy_(0, spec, spec_out)

    def _forward_spec(self, m: GDNAttentionMetadata, mixed_qkv: Tensor, b: Tensor, a: Tensor, out: Tensor) -> None:
        """The speculative rows of a step, their tokens packed by ``m.spec_query_start_loc``:
        vLLM's conv update in slot ``s``, then ``gdn_pool_verify`` from slot ``s`` writing record row
        ``s`` and ``pending[s]``; ``out [tokens, HV, V]`` written."""
        n = m.num_spec_decodes
        slots = m.spec_state_indices_tensor[:n, 0]
        conv_state = self.kv_cache[0] if is_conv_state_dim_first() else self.kv_cache[0].transpose(-1, -2)
        conv_weights = self.conv1d.weight.view(self.conv1d.weight.size(0), self.conv1d.weight.size(2))
        mixed_qkv = causal_conv1d_update(mixed_qkv, conv_state, conv_weights, self.conv1d.bias, self.activation,
                                         conv_state_indices=slots, num_accepted_tokens=m.num_accepted_tokens,
                                         query_start_loc=m.spec_query_start_loc,
                                         max_query_len=self.num_spec + 1, validate_data=False)
        q, k, v = self.rearrange_mixed_qkv(mixed_qkv)
        records, pending = self.slot_records
        cu_seqlens = m.spec_query_start_loc[: n + 1]
        rows = torch.where(slots > 0, slots, -1)
        o = gdn_pool_verify(self.A_log, a, self.dt_bias, 1.0, 20.0, q, k, v, b, self.kv_cache[1], rows,
                            scale=self.head_k_dim**-0.5, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens,
                            records=records, intermediate_state_indices=rows, cache_steps=records.k.shape[1])
        pending.index_copy_(0, slots.clamp(min=0).long(), cu_seqlens.diff().to(pending.dtype))
        out.copy_(o.squeeze(0))

    def _forward_core_decode_aiter(self, qkvz, ba, z_out, core_attn_out, attn_metadata):
        """vLLM's ROCm decode-only path (plain one-token decodes, which bypass ``_forward_core``):
        the rows' pending chains are committed first, as ``_forward_core`` commits them."""
        if self.slot_records is not None:
            self._commit_batch(attn_metadata)
        return super()._forward_core_decode_aiter(qkvz, ba, z_out, core_attn_out, attn_metadata)
