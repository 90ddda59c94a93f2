"""SGLang plugin: draft trees (``--speculative-eagle-topk > 1``) on GDN hybrids and Mamba2 hybrids
verify with specla's tree kernels and commit from factor records, and the pool keeps those records
instead of one full state per draft node.

SGLang calls :func:`register` in each of its processes (entry-point group ``sglang.srt.plugins``);
it registers six hooks through ``HookRegistry``, which SGLang applies once all plugins have run:

- ``KVCacheConfigurator._handle_max_mamba_cache`` (around): sizes the state pool with the memory a
  draft node takes as records (its conv window and record) instead of as a full state, so the
  memory the records free becomes running requests;
- ``KVCacheConfigurator._build_hybrid_req_pool`` (around): marks the pool being built with its
  model's mixer (:data:`record_mixer`), from the one place that knows the model's architecture;
- ``MambaPool.__init__`` (around): for such a pool with draft trees, builds it without SGLang's
  per-node state buffer and puts the record buffer (:mod:`specla_sglang.records`) in its place;
- ``GDNKernelDispatcher.__init__`` (after): both GDN verify slots get :class:`SpeclaGDNVerifyKernel`,
  which verifies with specla where the pool holds records and calls the slot's kernel otherwise;
- ``selective_state_update`` (around; SGLang's dispatcher of it, which Mamba2's mixer calls):
  where it is handed records, specla's Mamba2 tree verify (:func:`~specla_sglang.kernel.verify_mamba2_tree`);
  SGLang's kernel otherwise;
- ``scatter_mamba_states_after_mtp_verify`` (around): commits the accepted path from the records,
  with the commit of the pool's mixer; SGLang still rolls the conv windows back.

Everything else (chains, KDA, Mamba1, ReplaySSM, page-major or unified pools) is left to SGLang:
the pool stays SGLang's, and the kernels and the commit see per-node states and call SGLang's own
code. Pinned to SGLang 0.5.23, whose internals these hooks name.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import importlib.metadata
import logging

import torch

from .kernel import RECORD_STATES, RecordState, SpeclaGDNVerifyKernel, commit_paths, is_record_buffer, verify_mamba2_tree
from .records import RecordLayout

__all__ = ["register", "SpeclaGDNVerifyKernel", "RecordLayout", "record_layout"]

SGLANG_VERSION = "0.5.23"
logger = logging.getLogger(__name__)

_POOL = "sglang.srt.mem_cache.memory_pool.MambaPool.__init__"
_CONFIGURATOR = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_hybrid_req_pool"
_SIZING = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._handle_max_mamba_cache"
_DISPATCHER = "sglang.srt.layers.attention.linear.gdn_backend.GDNKernelDispatcher.__init__"
_SSU = "sglang.kernels.ops.mamba.triton_ops.ssu_dispatch.selective_state_update"
_SCATTER = "sglang.kernels.ops.mamba.mamba_state_scatter_triton.scatter_mamba_states_after_mtp_verify"
TARGETS = (_SIZING, _CONFIGURATOR, _POOL, _DISPATCHER, _SSU, _SCATTER)

# the mixer ("gdn", "mamba2") of the hybrid whose request pool SGLang is building (only then)
record_mixer = contextvars.ContextVar("specla_sglang_record_mixer", default=None)


def register() -> None:
    """The entry point: registers the hooks (SGLang applies them after all plugins load), or none,
    with a warning, under an SGLang other than :data:`SGLANG_VERSION` (the internals they name
    change between releases)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    installed = importlib.metadata.version("sglang")
    if installed != SGLANG_VERSION:
        logger.warning("specla-sglang supports SGLang %s, not %s: its hooks are not installed", SGLANG_VERSION,
                       installed)
        return
    HookRegistry.register(_SIZING, _handle_max_mamba_cache, HookType.AROUND)
    HookRegistry.register(_CONFIGURATOR, _build_hybrid_req_pool, HookType.AROUND)
    HookRegistry.register(_POOL, _pool_init, HookType.AROUND)
    HookRegistry.register(_DISPATCHER, _dispatcher_init, HookType.AFTER)
    HookRegistry.register(_SSU, _selective_state_update, HookType.AROUND)
    HookRegistry.register(_SCATTER, _scatter_after_verify, HookType.AROUND)


def keeps_records(*, mixer: str | None, topk: int | None, is_kda: bool, page_major: bool, replayssm: bool,
                  state_dtype: torch.dtype) -> bool:
    """Whether a state pool keeps records: a GDN hybrid's (not KDA's) or a Mamba2 hybrid's (``mixer``,
    :func:`hybrid_mixer`), for draft trees, in SGLang's standard layout (not page-major), without
    SGLang's ReplaySSM rings, with float32 states (specla's pool kernels read and write them in
    place; ``--mamba-ssm-dtype`` bfloat16 stays SGLang's)."""
    return (mixer is not None and topk is not None and topk > 1 and not is_kda and not page_major
            and not replayssm and state_dtype == torch.float32)


def engages(**pool_kwargs) -> bool:
    """Whether a ``MambaPool`` built with these keyword arguments keeps records
    (:func:`keeps_records`, for the mixer :data:`record_mixer` names while it is set)."""
    return pool_kwargs.get("speculative_num_draft_tokens") is not None and keeps_records(
        mixer=record_mixer.get(), topk=pool_kwargs.get("speculative_eagle_topk"),
        is_kda=pool_kwargs["cache_params"].is_kda, page_major=pool_kwargs.get("envelope_layout", False),
        replayssm=pool_kwargs.get("enable_linear_replayssm", False)
        or pool_kwargs.get("enable_linear_replayssm_spec", False),
        state_dtype=pool_kwargs["cache_params"].dtype.temporal)


def hybrid_mixer(configurator) -> str | None:
    """``"gdn"`` for a GDN hybrid (not KDA), ``"mamba2"`` for a hybrid of SGLang's Mamba2 mixer
    (``MambaMixer2``: Nemotron-H and its VL, Granite-4.0-H, Falcon-H1, Mamba2), ``None`` for any
    other model (Mamba1, short convolutions, KDA, lightning attention)."""
    from sglang.srt.configs import FalconH1Config, GraniteMoeHybridConfig, Mamba2Config, NemotronHConfig

    if configurator.hybrid_gdn_config is not None and configurator.hybrid_kda_config is None:
        return "gdn"
    if isinstance(configurator.mambaish_config, (NemotronHConfig, GraniteMoeHybridConfig, FalconH1Config,
                                                 Mamba2Config)):
        return "mamba2"
    return None


def _build_hybrid_req_pool(original, configurator, *args, **kwargs):
    token = record_mixer.set(hybrid_mixer(configurator))
    try:
        return original(configurator, *args, **kwargs)
    finally:
        record_mixer.reset(token)


def record_layout(params, mixer: str) -> RecordLayout:
    """The record of one draft node of a pool of ``params`` (SGLang's ``Mamba2CacheParams``) for
    ``mixer``'s layers: GDN's key heads, or Mamba2's groups of ``B`` (from the conv channels,
    ``x`` then ``B`` and ``C``), in the key heads' place."""
    HV, V, K = params.shape.temporal
    if mixer == "gdn":
        return RecordLayout(H=params.shape.num_k_heads_per_tp, HV=HV, K=K, V=V)
    # Mamba2: temporal (H, P, Ns) per rank; x's channels are intermediate_size split as the heads
    x_channels = params.shape.intermediate_size * HV // params.shape.num_heads
    return RecordLayout(H=(params.shape.conv[0][0] - x_channels) // (2 * K), HV=HV, K=K, V=V)


def node_bytes_ratio(params, mixer: str) -> float:
    """Bytes a draft node takes with records (its conv window and record) over SGLang's charge for
    it (a conv window and a full state: ``mamba_cache_per_req``), for a pool of ``params``
    (``Mamba2CacheParams``) of ``mixer``'s layers; every layer has the same, so the ratio is per
    layer."""
    HV, V, K = params.shape.temporal
    conv = sum(a * b for a, b in params.shape.conv) * params.dtype.conv.itemsize
    record = record_layout(params, mixer).width * 4
    return (conv + record) / (conv + HV * V * K * params.dtype.temporal.itemsize)


def _handle_max_mamba_cache(original, configurator, total_rest_memory):
    from sglang.srt.runtime_context import get_exec, get_memory, get_spec

    spec, mamba = get_spec(), get_exec().mamba
    mixer = hybrid_mixer(configurator)
    if (configurator.mambaish_config is None or get_memory().enable_unified_memory
            or configurator.fused_entry_bytes("mamba") is not None
            or not keeps_records(mixer=mixer, topk=spec.speculative_eagle_topk,
                                 is_kda=False, page_major=get_memory().enable_page_major_kv_layout,
                                 replayssm=mamba.enable_linear_replayssm or mamba.enable_linear_replayssm_spec,
                                 state_dtype=configurator.mambaish_config.mamba2_cache_params.dtype.temporal)):
        return original(configurator, total_rest_memory)
    # SGLang charges each of the D draft nodes of a running request ``mamba_cache_per_req``; as
    # many record-sized nodes are that charge times the ratio
    nodes = spec.speculative_num_draft_tokens * node_bytes_ratio(configurator.mambaish_config.mamba2_cache_params,
                                                                 mixer)
    with spec.override(speculative_num_draft_tokens=nodes):
        return original(configurator, total_rest_memory)


TREES_NOTE = ("specla-sglang: draft trees (--speculative-eagle-topk %d) verify with specla's kernels and factor "
              "records. In specla's cost model at published drafters' acceptance, trees ran slower than chains of "
              "the same depth at every batch measured, 1 to 64 (specla's docs/limits.md): a tree pays only where "
              "its drafter accepts more tokens per step than its chain by more than the tree's extra step time. "
              "--speculative-eagle-topk 1 runs SGLang's chains.")


@functools.cache
def _note_trees(topk: int) -> None:
    """Says once per process, when the plugin takes a pool's trees over, where trees were measured
    not to pay (item 5 of the integration's study): the choice of a tree stays the user's."""
    logger.warning(TREES_NOTE, topk)


def _pool_init(original, pool, **kwargs):
    if not engages(**kwargs):
        return original(pool, **kwargs)
    _note_trees(kwargs["speculative_eagle_topk"])
    # SGLang's pool without speculative buffers, then the tree's buffers: dense conv windows (as
    # SGLang keeps them for trees) and records where SGLang keeps per-node states
    original(pool, **{**kwargs, "speculative_num_draft_tokens": None})
    from sglang.srt.mem_cache.memory_pool import GB, GPU_MEMORY_TYPE_KV_CACHE

    params, mixer = kwargs["cache_params"], record_mixer.get()
    D = kwargs["speculative_num_draft_tokens"]
    rows = kwargs["spec_state_size"] + 1
    layers = pool.num_mamba_layers
    layout = record_layout(params, mixer)
    with pool.memory_saver_adapter.region(GPU_MEMORY_TYPE_KV_CACHE):
        records = torch.zeros(layers, rows, D, layout.width, dtype=torch.float32, device=pool.device)
        windows = [torch.zeros(layers, rows, D, *shape, dtype=params.dtype.conv, device=pool.device)
                   for shape in params.shape.conv]
    pool._intermediate_conv_window_phys = windows
    pool.mamba_cache = RECORD_STATES[mixer](
        **{f.name: getattr(pool.mamba_cache, f.name) for f in dataclasses.fields(pool.mamba_cache)},
        intermediate_ssm=records, intermediate_conv_window=windows)
    pool.mem_usage = pool.mamba_cache.mem_usage_bytes() / GB


def _dispatcher_init(result, dispatcher, *args, **kwargs):
    dispatcher.tree_verify_kernel = SpeclaGDNVerifyKernel(dispatcher.tree_verify_kernel)
    dispatcher.verify_kernel = SpeclaGDNVerifyKernel(dispatcher.verify_kernel)


def _selective_state_update(original, *args, **kwargs):
    if is_record_buffer(kwargs.get("intermediate_states_buffer")):
        return verify_mamba2_tree(*args, **kwargs)
    return original(*args, **kwargs)


def _scatter_after_verify(original, mamba_caches, state_indices_tensor, last_correct_step_indices,
                          mamba_track_indices, mamba_steps_to_track, src_indices_raw=None):
    if isinstance(mamba_caches, RecordState):
        commit_paths(mamba_caches.mixer, mamba_caches.temporal, mamba_caches.intermediate_ssm, state_indices_tensor,
                     last_correct_step_indices, mamba_track_indices, mamba_steps_to_track, src_indices_raw)
        # the conv windows: SGLang's rollback, with no state left for it to scatter
        mamba_caches = dataclasses.replace(mamba_caches, temporal=mamba_caches.temporal[:, :0])
    return original(mamba_caches, state_indices_tensor, last_correct_step_indices, mamba_track_indices,
                    mamba_steps_to_track, src_indices_raw)
