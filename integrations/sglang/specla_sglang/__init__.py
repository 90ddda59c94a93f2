"""SGLang plugin: draft trees (``--speculative-eagle-topk > 1``) on GDN hybrids verify with specla's
tree kernel and commit from factor records, and the pool keeps those records instead of one full
state per draft node.

SGLang calls :func:`register` in each of its processes (entry-point group ``sglang.srt.plugins``);
it registers four hooks through ``HookRegistry``, which SGLang applies once all plugins have run:

- ``KVCacheConfigurator._build_hybrid_req_pool`` (around): marks the pool being built as a GDN
  hybrid's, the one place that knows the model's architecture;
- ``MambaPool.__init__`` (around): for such a pool with draft trees, builds it without SGLang's
  per-node state buffer and puts the record buffer (:mod:`specla_sglang.records`) in its place;
- ``GDNKernelDispatcher.__init__`` (after): the tree-verify slot gets :class:`SpeclaGDNTreeKernel`;
- ``scatter_mamba_states_after_mtp_verify`` (around): commits the accepted path from the records;
  SGLang still rolls the conv windows back.

Everything else (chains, KDA, Mamba2, ReplaySSM, page-major or unified pools) is left to SGLang: the
pool stays SGLang's, and the kernel and the commit see per-node states and call SGLang's own code.
Pinned to SGLang 0.5.23, whose internals these hooks name.
"""

from __future__ import annotations

import contextvars
import dataclasses

import torch

from .kernel import SpeclaGDNTreeKernel, commit_paths, is_record_buffer
from .records import RecordLayout

__all__ = ["register", "SpeclaGDNTreeKernel", "RecordLayout"]

SGLANG_VERSION = "0.5.23"

_POOL = "sglang.srt.mem_cache.memory_pool.MambaPool.__init__"
_CONFIGURATOR = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_hybrid_req_pool"
_DISPATCHER = "sglang.srt.layers.attention.linear.gdn_backend.GDNKernelDispatcher.__init__"
_SCATTER = "sglang.kernels.ops.mamba.mamba_state_scatter_triton.scatter_mamba_states_after_mtp_verify"
TARGETS = (_CONFIGURATOR, _POOL, _DISPATCHER, _SCATTER)

# set while SGLang builds the request pool of a GDN hybrid (and only then)
gdn_hybrid_pool = contextvars.ContextVar("specla_sglang_gdn_hybrid_pool", default=False)


def register() -> None:
    """The entry point: registers the hooks (SGLang applies them after all plugins load)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(_CONFIGURATOR, _build_hybrid_req_pool, HookType.AROUND)
    HookRegistry.register(_POOL, _pool_init, HookType.AROUND)
    HookRegistry.register(_DISPATCHER, _dispatcher_init, HookType.AFTER)
    HookRegistry.register(_SCATTER, _scatter_after_verify, HookType.AROUND)


def _build_hybrid_req_pool(original, configurator, *args, **kwargs):
    gdn = configurator.hybrid_gdn_config is not None and configurator.hybrid_kda_config is None
    token = gdn_hybrid_pool.set(gdn)
    try:
        return original(configurator, *args, **kwargs)
    finally:
        gdn_hybrid_pool.reset(token)


def engages(**pool_kwargs) -> bool:
    """Whether a ``MambaPool`` built with these keyword arguments keeps records: a GDN hybrid's
    pool (:data:`gdn_hybrid_pool`) for draft trees, in SGLang's standard layout."""
    topk = pool_kwargs.get("speculative_eagle_topk")
    return (gdn_hybrid_pool.get()
            and pool_kwargs.get("speculative_num_draft_tokens") is not None
            and topk is not None and topk > 1
            and not pool_kwargs["cache_params"].is_kda
            and not pool_kwargs.get("envelope_layout", False)
            and not pool_kwargs.get("enable_linear_replayssm", False)
            and not pool_kwargs.get("enable_linear_replayssm_spec", False))


def _pool_init(original, pool, **kwargs):
    if not engages(**kwargs):
        return original(pool, **kwargs)
    # SGLang's pool without speculative buffers, then the tree's buffers: dense conv windows (as
    # SGLang keeps them for trees) and records where SGLang keeps per-node states
    original(pool, **{**kwargs, "speculative_num_draft_tokens": None})
    from sglang.srt.mem_cache.memory_pool import GB, GPU_MEMORY_TYPE_KV_CACHE

    params = kwargs["cache_params"]
    D = kwargs["speculative_num_draft_tokens"]
    rows = kwargs["spec_state_size"] + 1
    layers = pool.num_mamba_layers
    HV, V, K = params.shape.temporal
    layout = RecordLayout(H=params.shape.num_k_heads_per_tp, HV=HV, K=K, V=V)
    with pool.memory_saver_adapter.region(GPU_MEMORY_TYPE_KV_CACHE):
        records = torch.zeros(layers, rows, D, layout.width, dtype=torch.float32, device=pool.device)
        windows = [torch.zeros(layers, rows, D, *shape, dtype=params.dtype.conv, device=pool.device)
                   for shape in params.shape.conv]
    pool._intermediate_conv_window_phys = windows
    pool.mamba_cache = pool.SpeculativeState(
        **{f.name: getattr(pool.mamba_cache, f.name) for f in dataclasses.fields(pool.mamba_cache)},
        intermediate_ssm=records, intermediate_conv_window=windows)
    pool.mem_usage = pool.mamba_cache.mem_usage_bytes() / GB


def _dispatcher_init(result, dispatcher, *args, **kwargs):
    dispatcher.tree_verify_kernel = SpeclaGDNTreeKernel()


def _scatter_after_verify(original, mamba_caches, state_indices_tensor, last_correct_step_indices,
                          mamba_track_indices, mamba_steps_to_track, src_indices_raw=None):
    if is_record_buffer(mamba_caches.intermediate_ssm, per_layer=False):
        states, records = mamba_caches.temporal, mamba_caches.intermediate_ssm
        # the prefix-cache track slot first: it starts from the request's state before this commit
        if mamba_track_indices is not None:
            commit_paths(states, records, state_indices_tensor, mamba_track_indices, mamba_steps_to_track,
                         src_indices_raw)
        commit_paths(states, records, state_indices_tensor, state_indices_tensor, last_correct_step_indices,
                     src_indices_raw)
        # the conv windows: SGLang's rollback, with no state left for it to scatter
        mamba_caches = dataclasses.replace(mamba_caches, temporal=mamba_caches.temporal[:, :0])
    return original(mamba_caches, state_indices_tensor, last_correct_step_indices, mamba_track_indices,
                    mamba_steps_to_track, src_indices_raw)
