"""The plugin's wiring inside SGLang 0.5.23, on SGLang's own objects: its entry point loads through
SGLang's plugin loader and installs the hooks; the pool of a GDN hybrid with draft trees holds
records and no per-node states, and SGLang's pool sizing charges a draft node what the pool
allocates for it; both verify slots get specla's kernel, which takes SGLang's metadata as SGLang's
dispatcher passes it; its outputs and the committed states match SGLang's own kernel and scatter
on the same inputs (float32; tolerance below), and neither copies a state out of SGLang's pool.

SGLang's modules import torchvision at import time (image transforms of its multimodal configs),
which these tests never run. The test environment leaves torchvision out (PyPI builds it against
CUDA torch, and installed beside torch's CPU build it breaks transformers' model imports for the
rest of the suite); :func:`_torchvision_placeholder` gives SGLang's imports a placeholder
after transformers has recorded torchvision as absent, and removes it once they are done. (Here, not in a
conftest.py: the suite's tests import their own ``conftest`` by that name.)"""

import collections
import contextlib
import dataclasses
import importlib.machinery
import importlib.metadata
import importlib.util
import logging
import os
import sys
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

if importlib.util.find_spec("sglang") is None:  # installed but failing to import is a failure, not a skip
    pytest.skip("SGLang is not installed: see integrations/sglang/README.md for the test environment",
                allow_module_level=True)

# On a CPU, SGLang's Triton kernels and specla's run under Triton's interpreter (the suite's
# tests/conftest.py decides the same way where it runs first)
os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")


class _AnyMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return cls


class _Any(metaclass=_AnyMeta):
    """Any attribute of a placeholder module, and any attribute of that (``InterpolationMode.X``)."""


class _Placeholder(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Any


@contextlib.contextmanager
def _torchvision_placeholder():
    """Placeholder ``torchvision`` modules while SGLang's modules import, where torchvision is not
    installed, recorded as absent by transformers first; removed afterwards, so that any later
    ``import torchvision`` fails as it would without SGLang."""
    names = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional")
    if importlib.util.find_spec("torchvision") is not None:
        yield
        return
    from transformers.utils import import_utils

    if import_utils.is_torchvision_available():  # cached by transformers from here on
        raise RuntimeError("torchvision is absent (find_spec) but transformers found it")
    for name in names:
        module = _Placeholder(name)
        module.__spec__, module.__path__ = importlib.machinery.ModuleSpec(name, None), []
        sys.modules[name] = module
    try:
        yield
    finally:
        for name in names:
            if isinstance(sys.modules.get(name), _Placeholder):
                del sys.modules[name]


with _torchvision_placeholder():
    import sglang.srt.plugins as sglang_plugins
    from sglang.kernels.ops.mamba import mamba_state_scatter_triton
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape
    from sglang.srt.layers.attention import hybrid_linear_attn_backend
    from sglang.srt.layers.attention.linear.gdn_backend import GDNKernelDispatcher
    from sglang.srt.layers.attention.linear.kernels.gdn_triton import TritonGDNKernel
    from sglang.srt.layers.attention.linear.utils import LinearAttnKernelBackend
    from sglang.srt.layers.attention.mamba import mamba as sglang_mamba2_mixer
    from sglang.kernels.ops.mamba.triton_ops import ssu_dispatch
    from sglang.srt.mem_cache.memory_pool import GB, MambaPool
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.plugins.hook_registry import HookRegistry, _propagate_patch
    from sglang.srt.runtime_context import get_context, get_schedule

import specla_sglang  # noqa: E402
from specla.mixers.gdn.reference import node_states  # noqa: E402
from specla.tree import inclusive_ancestor_mask  # noqa: E402
from specla_sglang import RecordLayout, SpeclaGDNVerifyKernel, record_mixer  # noqa: E402

H, HV, K, V, CONV = 2, 4, 16, 16, 4  # key heads, value heads, head dims, conv width
LAYERS, SLOTS, D = 2, 6, 6  # GDN layers, state slots, draft tokens per request
TOL = dict(rtol=1e-5, atol=1e-5)  # float32: the two kernels sum in different orders
# three requests' trees in SGLang's retrieve_parent_token form (entry 0 is left unset by SGLang)
PARENTS = torch.tensor([[99, 0, 0, 1, 1, 2], [99, 0, 1, 2, 3, 4], [99, 0, 0, 0, 0, 0]])
CACHE_INDICES = torch.tensor([4, 1, -1], dtype=torch.int32)  # the third request is padding
# draft tokens of each request: all D, or the same trees cut to 6, 4 and 3 nodes (a ragged verify
# layout; PARENTS' later entries unread)
UNIFORM, RAGGED = torch.full((3,), D), torch.tensor([6, 4, 3])


@pytest.fixture(scope="module")
def hooks():
    """The plugin loaded by SGLang's loader (entry point, SGLANG_PLUGINS filter, apply_hooks); the
    patched functions are restored afterwards."""
    import pkgutil

    originals = {}
    for target in specla_sglang.TARGETS:
        owner, name = target.rsplit(".", 1)
        obj = pkgutil.resolve_name(owner)
        originals[target] = (obj, name, getattr(obj, name))
    mp = pytest.MonkeyPatch()
    mp.setenv("SGLANG_PLUGINS", "specla")
    mp.setattr(sglang_plugins, "_plugins_loaded", False)
    HookRegistry.reset()
    sglang_plugins.load_plugins()
    yield HookRegistry
    for obj, name, original in originals.values():
        wrapped = getattr(obj, name)
        setattr(obj, name, original)
        _propagate_patch(wrapped, original, obj)
    HookRegistry.reset()
    mp.undo()


def test_entry_point_installs_every_hook(hooks):
    (ep,) = [e for e in importlib.metadata.entry_points(group="sglang.srt.plugins") if e.name == "specla"]
    assert ep.load() is specla_sglang.register
    assert set(hooks._patched) == set(specla_sglang.TARGETS)
    # SGLang's backend calls the scatter through its own import of it: the patch reached it
    assert hybrid_linear_attn_backend.scatter_mamba_states_after_mtp_verify is \
        mamba_state_scatter_triton.scatter_mamba_states_after_mtp_verify
    assert hybrid_linear_attn_backend.scatter_mamba_states_after_mtp_verify.__wrapped__ is not None
    dispatcher = GDNKernelDispatcher(LinearAttnKernelBackend.TRITON, LinearAttnKernelBackend.TRITON, None)
    for slot in (dispatcher.tree_verify_kernel, dispatcher.verify_kernel):
        assert type(slot) is SpeclaGDNVerifyKernel and type(slot.sglang_kernel) is TritonGDNKernel
    # SGLang's Mamba2 mixer calls the dispatcher of selective_state_update through its own import
    assert sglang_mamba2_mixer.selective_state_update is ssu_dispatch.selective_state_update
    assert ssu_dispatch.selective_state_update.__wrapped__ is not None


def test_other_sglang_releases_get_no_hooks(monkeypatch, caplog):
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.5.24")
    monkeypatch.setattr(HookRegistry, "_hooks", collections.defaultdict(list))
    specla_sglang.register()
    assert not HookRegistry._hooks
    assert caplog.messages == ["specla-sglang supports SGLang 0.5.23, not 0.5.24: its hooks are not installed"]


def _cache_params(state_dtype: torch.dtype = torch.float32):
    shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=HV * V, n_groups=H, num_heads=HV,
                                    head_dim=V, state_size=K, conv_kernel=CONV)
    return Mamba2CacheParams(shape=shape, layers=list(range(LAYERS)),
                             dtype=Mamba2StateDType(conv=torch.bfloat16, temporal=state_dtype))


def _pool(mixer: str | None, topk: int = 4, state_dtype: torch.dtype = torch.float32, params=None) -> MambaPool:
    """A pool built while SGLang builds a ``mixer`` hybrid's (``None``: any other model's), of GDN's
    cache params unless ``params``."""
    token = record_mixer.set(mixer)
    try:
        return MambaPool(size=SLOTS - 1, spec_state_size=3, cache_params=params or _cache_params(state_dtype),
                         mamba_layer_ids=list(range(LAYERS)), device="cpu", speculative_num_draft_tokens=D,
                         speculative_eagle_topk=topk)
    finally:
        record_mixer.reset(token)


def test_pool_holds_records_and_no_per_node_states(hooks):
    ours, sglang_own, chain = _pool("gdn"), _pool(None), _pool("gdn", topk=1)
    bf16_states = _pool("gdn", state_dtype=torch.bfloat16)  # --mamba-ssm-dtype bfloat16
    width = RecordLayout(H=H, HV=HV, K=K, V=V).width
    assert width == H * K + HV * V + HV + 1
    rec = ours.mamba_cache.intermediate_ssm
    assert rec.shape == (LAYERS, 4, D, width) and rec.dtype == torch.float32
    # SGLang's pool, a chain's (topk 1) and one of bfloat16 states keep one [HV, V, K] state per node
    for pool in (sglang_own, chain, bf16_states):
        assert pool.mamba_cache.intermediate_ssm.shape == (LAYERS, 4, D, HV, V, K)
    states = [f.name for f in dataclasses.fields(ours.mamba_cache)
              if isinstance(getattr(ours.mamba_cache, f.name), torch.Tensor)
              and getattr(ours.mamba_cache, f.name).shape[-3:] == (HV, V, K)]
    assert states == ["temporal"]
    assert [w.shape for w in ours.mamba_cache.intermediate_conv_window] == \
        [w.shape for w in sglang_own.mamba_cache.intermediate_conv_window]
    assert ours.mamba_cache.temporal.shape == sglang_own.mamba_cache.temporal.shape
    # per layer, as SGLang slices it for a layer's forward
    assert ours.mamba2_layer_cache(1).intermediate_ssm.shape == (4, D, width)
    saved = LAYERS * 4 * D * (HV * V * K - width) * 4
    assert ours.mem_usage == pytest.approx(sglang_own.mem_usage - saved / GB, rel=1e-12)


def test_trees_taken_over_say_once_where_trees_did_not_pay(hooks, caplog):
    """The pool that keeps records says, once a process, that trees were measured slower than
    chains; SGLang's own pools (a chain's, another model's) say nothing."""
    specla_sglang._note_trees.cache_clear()
    with caplog.at_level(logging.WARNING, logger="specla_sglang"):
        _pool(None), _pool("gdn", topk=1)
        assert caplog.messages == []
        _pool("gdn"), _pool("gdn")
    assert caplog.messages == [specla_sglang.TREES_NOTE % 4]
    assert caplog.messages[0].startswith("specla-sglang: draft trees (--speculative-eagle-topk 4) verify with")


def test_record_blocks_tile_the_buffer():
    layout = RecordLayout(H=H, HV=HV, K=K, V=V)
    buffer = torch.zeros(LAYERS, 4, D, layout.width)
    blocks = layout.views(buffer)
    assert [tuple(b.shape) for b in blocks] == [(LAYERS, 4, D, H, K), (LAYERS, 4, D, HV, V), (LAYERS, 4, D, HV),
                                                (LAYERS, 4, D)]
    for i, block in enumerate(blocks):
        block.fill_(i + 1)
    counts = [int((buffer == i + 1).sum()) for i in range(4)]
    assert counts == [LAYERS * 4 * D * n for n in (H * K, HV * V, HV, 1)]  # disjoint, and nothing left over
    assert all(b.is_contiguous() for b in layout.views(buffer[1]))
    with pytest.raises(ValueError, match=r"a record buffer must be contiguous \[\(layers,\) R, D, 101\], "
                                         r"got \[4, 6, 100\]"):
        layout.views(buffer[0, ..., :-1].contiguous())


def test_build_hybrid_req_pool_marks_gdn_and_mamba2_hybrids():
    from sglang.srt.configs import (FalconH1Config, FalconMambaConfig, GraniteMoeHybridConfig, Lfm2Config,
                                    MambaConfig, NemotronHConfig)

    seen = []

    class Configurator:
        def __init__(self, gdn, kda, mambaish=None):
            self.hybrid_gdn_config, self.hybrid_kda_config = gdn, kda
            self.mambaish_config = mambaish if mambaish is not None else gdn or kda

    def build(configurator):
        seen.append(record_mixer.get())

    # SGLang's Mamba2 mixer's models, then Mamba1's and short convolutions' (their own state updates)
    mamba2 = [NemotronHConfig(), GraniteMoeHybridConfig(), FalconH1Config()]
    others = [MambaConfig(), FalconMambaConfig(), Lfm2Config()]
    for gdn, kda in ((object(), None), (None, None), (None, object())):
        specla_sglang._build_hybrid_req_pool(build, Configurator(gdn, kda))
    for config in mamba2 + others:
        specla_sglang._build_hybrid_req_pool(build, Configurator(None, None, config))
    assert seen == ["gdn", None, None] + ["mamba2"] * 3 + [None] * 3 and record_mixer.get() is None


def _layer_inputs(gen, N=PARENTS.numel()):
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return dict(A_log=r(HV) * 0.5, dt_bias=r(HV) * 0.5, q=r(1, N, H, K), k=r(1, N, H, K), v=r(1, N, HV, V),
                a=r(N, HV), b=r(N, HV))


def _verify_meta(ssm_states, parents=PARENTS, sizes=UNIFORM):
    """SGLang's verify metadata for :data:`PARENTS`' requests of ``sizes`` draft tokens, states
    read from ``ssm_states``."""
    return dict(ssm_states=ssm_states, cache_indices=CACHE_INDICES,
                query_start_loc=torch.cat([torch.zeros(1), sizes.cumsum(0)]).to(torch.int32),
                intermediate_state_indices=torch.arange(4, dtype=torch.int32), cache_steps=D,
                retrieve_parent_token=None if parents is None else parents.clone())


def _verify_both(dispatcher, gen, ssm_states, sgl_buffer, rec_buffer, parents=PARENTS, dtype=torch.float32,
                 sizes=UNIFORM):
    """One layer verified by SGLang's kernel into its per-node buffer and by the dispatcher (its
    tree slot, or its chain slot where ``parents`` is None) into the records, from the same pool
    state and inputs (activations in ``dtype``), requests of ``sizes`` draft tokens."""
    meta = _verify_meta(ssm_states, parents, sizes)
    N = int(meta["query_start_loc"][-1])
    x = {name: t.to(dtype) if name in "qkvab" else t for name, t in _layer_inputs(gen, N).items()}
    o_sgl = TritonGDNKernel().target_verify(**x, **meta, intermediate_states_buffer=sgl_buffer)
    # the keyword arguments SGLang's GDN backend passes to its dispatcher
    o_ours = dispatcher.target_verify(**x, **meta, intermediate_states_buffer=rec_buffer, stable_rows=False)
    return o_sgl, o_ours


@pytest.fixture
def cpu_scatter(monkeypatch):
    """SGLang's scatter kernels refuse CPU tensors; its backend's CPU fallback does the same scatter."""
    cpu_scatter = hybrid_linear_attn_backend.HybridLinearAttnBackend._scatter_speculative_state_with_mask
    monkeypatch.setattr(mamba_state_scatter_triton, "fused_mamba_state_scatter_with_mask", cpu_scatter)
    monkeypatch.setattr(mamba_state_scatter_triton, "fused_conv_window_scatter_with_mask", cpu_scatter)
    monkeypatch.setattr(mamba_state_scatter_triton, "_conv_multi_eligible", lambda pairs: False)


@pytest.mark.parametrize("sizes, last", [(UNIFORM, [4, 5, 0]), (RAGGED, [4, 3, 0])], ids=["uniform", "ragged"])
def test_tree_verify_and_commit_match_sglang(hooks, cpu_scatter, sizes, last):
    """Three trees (one a padding request's) over two layers, every request of ``D`` draft tokens
    or of :data:`RAGGED` counts; ``last``: each request's accepted node."""
    gen = torch.Generator().manual_seed(0)
    dispatcher = GDNKernelDispatcher(LinearAttnKernelBackend.TRITON, LinearAttnKernelBackend.TRITON, None)
    ours, sgl, init = _filled_pools("gdn", gen)
    layout = RecordLayout(H=H, HV=HV, K=K, V=V)
    for layer in range(LAYERS):
        o_sgl, o_ours = _verify_both(dispatcher, gen, init[layer], sgl.mamba_cache.intermediate_ssm[layer],
                                     ours.mamba_cache.intermediate_ssm[layer], sizes=sizes)
        assert o_ours.shape == o_sgl.shape == (1, int(sizes.sum()), HV, V)
        torch.testing.assert_close(o_ours, o_sgl, **TOL)
        # the records say what SGLang's per-node states say: each node's state from them
        k, delta, G, parent = (x[:3] for x in layout.views(ours.mamba_cache.intermediate_ssm[layer]))
        if layer == 0:  # the commit reads the first layer's parents; the other layers skip writing them
            assert parent[:, 0].eq(-1).all() and parent[:, 1:].eq(PARENTS[:, 1:].float()).all()
        else:
            assert parent.eq(0).all()
        parents = PARENTS.clone()
        parents[:, 0] = -1
        S0 = init[layer, CACHE_INDICES.long().clamp(min=0)] * (CACHE_INDICES >= 0).view(-1, 1, 1, 1)
        from_records = node_states(S0.transpose(-1, -2), k, delta, G, inclusive_ancestor_mask(parents))
        verified = torch.arange(D) < sizes[:, None]  # [3, D]: each request's nodes
        torch.testing.assert_close(from_records.transpose(-1, -2)[verified],
                                   sgl.mamba_cache.intermediate_ssm[layer, :3][verified], **TOL)

    _commit_both_and_compare(ours, sgl, init, torch.tensor(last))


def _filled_pools(mixer: str, gen, **kwargs):
    """A pool of ``mixer``'s records and SGLang's own (``_pool``'s ``kwargs``), of the same random
    states and conv windows; returns both and the states."""
    ours, sgl = _pool(mixer, **kwargs), _pool(None, **kwargs)
    init = torch.randn(ours.mamba_cache.temporal.shape, generator=gen) * 0.3
    conv = torch.randn(ours.mamba_cache.intermediate_conv_window[0].shape, generator=gen).to(torch.bfloat16)
    for pool in (ours, sgl):
        pool.mamba_cache.temporal.copy_(init)
        pool.mamba_cache.intermediate_conv_window[0].copy_(conv)
    return ours, sgl, init


def _commit_both_and_compare(ours, sgl, init, last):
    """SGLang's commit call on both pools after a verify of :data:`CACHE_INDICES`' requests,
    ``last`` each one's accepted node, with prefix-cache tracking: the same states (within
    :data:`TOL`) and conv windows, and only the requests' and the track slot's states changed."""
    track_slots = torch.tensor([5, 2, -1], dtype=torch.int32)  # padding tracks nothing
    track_steps = torch.tensor([1, -1, 0])  # the node whose state the prefix cache tracks
    for pool in (sgl, ours):  # the same call for both: the hook routes on what the pool holds
        hybrid_linear_attn_backend.scatter_mamba_states_after_mtp_verify(
            pool.mamba_cache, CACHE_INDICES, last, track_slots, track_steps)
    torch.testing.assert_close(ours.mamba_cache.temporal, sgl.mamba_cache.temporal, **TOL)
    assert torch.equal(ours.mamba_cache.conv[0], sgl.mamba_cache.conv[0])
    changed = (ours.mamba_cache.temporal != init).flatten(2).any(-1)  # [layers, slots]
    assert changed.eq(torch.tensor([False, True, False, False, True, True])).all()  # slots 1, 4 and track 5


class _CopiesOutOf(TorchDispatchMode):
    """Records every PyTorch op, outside the calls of specla's pool kernels, that reads ``pool``'s
    memory into a tensor of other memory (a gather, a clone, a transposed copy): views of the pool
    and writes into it are not copies out."""

    def __init__(self, pool: torch.Tensor):
        super().__init__()
        self.storage, self.copies, self.in_kernel = pool.untyped_storage().data_ptr(), [], False

    def _of_pool(self, x) -> bool:
        return isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() == self.storage

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        reads = any(self._of_pool(x) for x in torch.utils._pytree.tree_leaves((args, kwargs)))
        outs = [x for x in torch.utils._pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]
        if not self.in_kernel and reads and outs and not any(self._of_pool(x) for x in outs):
            self.copies.append((func.overloadpacket.__name__, tuple(outs[0].shape)))
        return out


@pytest.mark.parametrize("tracking", [False, True])
def test_verify_and_commit_copy_no_state_out_of_the_pool(hooks, cpu_scatter, monkeypatch, tracking):
    """SGLang's per-layer pool views go to specla's pool kernels as they are (the same memory, no
    copy), the commit runs once for every layer on the whole pool, and no other op reads a state
    out of the pool; with prefix-cache tracking, the one copy is the tracked request's state into
    its track slot (a gather of its slot, written into the track slot)."""
    from specla_sglang import kernel

    gen = torch.Generator().manual_seed(3)
    dispatcher = GDNKernelDispatcher(LinearAttnKernelBackend.TRITON, LinearAttnKernelBackend.TRITON, None)
    ours = _pool("gdn")
    pool = ours.mamba_cache.temporal
    pool.copy_(torch.randn(pool.shape, generator=gen) * 0.3)
    spy, calls = _CopiesOutOf(pool), []

    def kernel_call(name, fn):
        def call(*args, **kwargs):
            state = kwargs.get("initial_state_source", args[9] if name == "verify" else args[0])
            calls.append((name, state.data_ptr(), tuple(state.shape), state.stride()))
            spy.in_kernel = True
            try:
                return fn(*args, **kwargs)
            finally:
                spy.in_kernel = False
        return call

    monkeypatch.setattr(kernel, "gdn_pool_verify", kernel_call("verify", kernel.gdn_pool_verify))
    monkeypatch.setattr(kernel, "gdn_pool_commit", kernel_call("commit", kernel.gdn_pool_commit))
    track = (torch.tensor([5, -1, -1], dtype=torch.int32), torch.tensor([1, -1, 0])) if tracking else (None, None)
    with spy:
        for layer in range(LAYERS):
            layer_cache = ours.mamba2_layer_cache(layer)
            dispatcher.target_verify(**_layer_inputs(gen), **_verify_meta(layer_cache.temporal),
                                     intermediate_states_buffer=layer_cache.intermediate_ssm, stable_rows=False)
        hybrid_linear_attn_backend.scatter_mamba_states_after_mtp_verify(
            ours.mamba_cache, CACHE_INDICES, torch.tensor([4, 5, 0]), *track)
    assert calls == [("verify", pool[layer].data_ptr(), (SLOTS, HV, V, K), pool[layer].stride())
                     for layer in range(LAYERS)] + [("commit", pool.data_ptr(), tuple(pool.shape), pool.stride())]
    assert spy.copies == ([("index", (LAYERS, 1, HV, V, K))] if tracking else [])


def test_sizing_charges_draft_nodes_as_records(hooks):
    """SGLang's pool sizing, run with and without the plugin: with it, each draft node is charged
    what the pool built for it allocates per request row, and the memory left over holds more
    requests' states."""

    params = _cache_params()

    class Configurator:
        mambaish_config = type("Config", (), {"mamba2_cache_params": params})()
        hybrid_gdn_config, hybrid_kda_config = object(), None
        spec_algorithm = type("Spec", (), {"is_none": lambda self: False})()
        pp_size = attn_dp_size = 1
        extra_mamba_cache_bytes_per_req = 0

        def fused_entry_bytes(self, kind):
            return None

        def _calculate_mamba_ratio(self):
            return KVCacheConfigurator._calculate_mamba_ratio(self)

    total_gib = 0.05
    sizing = KVCacheConfigurator._handle_max_mamba_cache
    results = {}
    for name, fn in (("sglang", sizing.__wrapped__), ("specla", sizing)):
        with get_context().override_server_args(speculative_algorithm="EAGLE", speculative_num_draft_tokens=D,
                                                speculative_eagle_topk=4, max_running_requests=64):
            rest = fn(Configurator(), total_gib)
            results[name] = (rest, get_schedule().max_mamba_cache_size, Configurator()._calculate_mamba_ratio())
    (_, slots_s, ratio), (rest_p, slots_p, _) = results["sglang"], results["specla"]
    assert slots_p > slots_s
    pool = _pool("gdn")
    row_bytes = (pool.mamba_cache.intermediate_ssm.nbytes
                 + sum(w.nbytes for w in pool.mamba_cache.intermediate_conv_window)) / pool.mamba_cache.intermediate_ssm.shape[1]
    rows = min(64, slots_p // ratio) + 1
    states = (slots_p + 1) * params.mamba_cache_per_req
    assert (total_gib - rest_p) * GB == pytest.approx(states + rows * row_bytes, rel=1e-9)


def test_chain_verify_on_records_matches_sglang(hooks):
    """SGLang's dummy runs verify a tree pool's batch as chains (no retrieve_parent_token), through
    the dispatcher's chain slot: on records, that slot verifies with specla too."""
    gen = torch.Generator().manual_seed(1)
    dispatcher = GDNKernelDispatcher(LinearAttnKernelBackend.TRITON, LinearAttnKernelBackend.TRITON, None)
    ours, sgl = _pool("gdn"), _pool(None)
    init = torch.randn(SLOTS, HV, V, K, generator=gen) * 0.3
    o_sgl, o_ours = _verify_both(dispatcher, gen, init, sgl.mamba_cache.intermediate_ssm[0],
                                 ours.mamba_cache.intermediate_ssm[0], parents=None)
    torch.testing.assert_close(o_ours, o_sgl, **TOL)
    parent = RecordLayout(H=H, HV=HV, K=K, V=V).views(ours.mamba_cache.intermediate_ssm[0])[3]
    assert parent[:3].eq(torch.arange(-1, D - 1).float()).all()


def test_bfloat16_activations_match_sglang(hooks):
    """q, k, v, a, b in bfloat16, as SGLang serves: outputs in bfloat16 within its rounding."""
    gen = torch.Generator().manual_seed(2)
    dispatcher = GDNKernelDispatcher(LinearAttnKernelBackend.TRITON, LinearAttnKernelBackend.TRITON, None)
    ours, sgl = _pool("gdn"), _pool(None)
    init = torch.randn(SLOTS, HV, V, K, generator=gen) * 0.3
    o_sgl, o_ours = _verify_both(dispatcher, gen, init, sgl.mamba_cache.intermediate_ssm[0],
                                 ours.mamba_cache.intermediate_ssm[0], dtype=torch.bfloat16)
    assert o_ours.dtype == o_sgl.dtype == torch.bfloat16
    torch.testing.assert_close(o_ours, o_sgl)  # bfloat16's default tolerance: rtol 1.6e-2, atol 1e-5


# Mamba2 hybrids: heads, head dim, groups of B/C, state size (per rank), as SGLang's MambaMixer2 has them
MH, MP, MNG, MNS = 4, 8, 2, 16
# a Mamba2 layer's accepted node of each request (the padding request's ignored)
MAMBA2_LAST = torch.tensor([4, 5, 0])


def _mamba2_params(state_dtype: torch.dtype = torch.float32):
    shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=MH * MP, n_groups=MNG, num_heads=MH,
                                    head_dim=MP, state_size=MNS, conv_kernel=CONV)
    return Mamba2CacheParams(shape=shape, layers=list(range(LAYERS)),
                             dtype=Mamba2StateDType(conv=torch.bfloat16, temporal=state_dtype))


def _mamba2_pool(mixer: str | None, **kwargs) -> MambaPool:
    return _pool(mixer, params=_mamba2_params(kwargs.pop("state_dtype", torch.float32)), **kwargs)


@pytest.fixture(scope="module")
def ssu_backend():
    """SGLang's selective_state_update dispatcher, initialised as its scheduler does it (Triton).
    Its kernel's wrapper enters ``torch.get_device_module(x.device).device(index)``, which the CPU
    module lacks: a no-op one while the tests run; and Triton's interpreter reads its masks as
    bool (:func:`~specla.testing.engine_kernels.interpreter_bool_masks`)."""
    from specla.testing.engine_kernels import interpreter_bool_masks

    saved = ssu_dispatch._mamba_ssu_backend
    ssu_dispatch.initialize_mamba_selective_state_update_backend(types.SimpleNamespace(
        mamba_backend="triton", enable_mamba_cache_stochastic_rounding=False, mamba_cache_philox_rounds=0))
    mp = pytest.MonkeyPatch()
    cpu = not torch.cuda.is_available()
    if cpu:
        mp.setattr(torch.cpu, "device", lambda index: contextlib.nullcontext(), raising=False)
    with interpreter_bool_masks():
        yield
    mp.undo()
    ssu_dispatch._mamba_ssu_backend = saved


def test_mamba2_pool_holds_records_and_no_per_node_states(hooks):
    ours, sglang_own = _mamba2_pool("mamba2"), _mamba2_pool(None)
    chain, bf16_states = _mamba2_pool("mamba2", topk=1), _mamba2_pool("mamba2", state_dtype=torch.bfloat16)
    layout = specla_sglang.record_layout(_mamba2_params(), "mamba2")
    assert layout == RecordLayout(H=MNG, HV=MH, K=MNS, V=MP)  # B's groups in the key heads' place
    width = MNG * MNS + MH * MP + MH + 1  # B, u = dt x, the path-summed log decay, the parent
    assert layout.width == width
    rec = ours.mamba_cache.intermediate_ssm
    assert rec.shape == (LAYERS, 4, D, width) and rec.dtype == torch.float32
    assert type(ours.mamba_cache).mixer == "mamba2" and type(_pool("gdn").mamba_cache).mixer == "gdn"
    for pool in (sglang_own, chain, bf16_states):
        assert pool.mamba_cache.intermediate_ssm.shape == (LAYERS, 4, D, MH, MP, MNS)
        assert not isinstance(pool.mamba_cache, specla_sglang.RecordState)
    assert ours.mamba_cache.temporal.shape == sglang_own.mamba_cache.temporal.shape == (LAYERS, SLOTS, MH, MP, MNS)
    assert [w.shape for w in ours.mamba_cache.intermediate_conv_window] == \
        [w.shape for w in sglang_own.mamba_cache.intermediate_conv_window]
    layer = ours.mamba2_layer_cache(1)  # SGLang's per-layer slice keeps the kind
    assert type(layer) is type(ours.mamba_cache) and layer.intermediate_ssm.shape == (4, D, width)
    saved = LAYERS * 4 * D * (MH * MP * MNS - width) * 4
    assert ours.mem_usage == pytest.approx(sglang_own.mem_usage - saved / GB, rel=1e-12)


def _mamba2_layer(gen, bs=3, dtype=torch.float32):
    """One layer's verify arguments as SGLang's MambaMixer2 builds them for a target verify of
    ``bs`` requests of ``D`` draft tokens: x, B, C strided views of one conv output, dt of the
    projection expanded over the head dim, A, dt_bias and D expanded (stride 0)."""
    N = bs * D
    xbc = torch.randn(N, MH * MP + 2 * MNG * MNS, generator=gen).to(dtype)
    x, B, C = torch.split(xbc, [MH * MP, MNG * MNS, MNG * MNS], dim=-1)
    dt = torch.randn(N, MH + 3, generator=gen).to(dtype)[:, :MH]
    A = -(16 ** torch.rand(MH, generator=gen))
    dt_bias = torch.log(torch.expm1(1e-3 * 100 ** torch.rand(MH, generator=gen)))
    return dict(x=x.view(bs, D, MH, MP), dt=dt[:, :, None].expand(-1, -1, MP).view(bs, D, MH, MP),
                A=A[:, None, None].expand(MH, MP, MNS), B=B.view(bs, D, MNG, MNS), C=C.view(bs, D, MNG, MNS),
                D=torch.randn(MH, generator=gen)[:, None].expand(MH, MP),
                dt_bias=dt_bias[:, None].expand(MH, MP))


def _mamba2_verify(layer_cache, args, parents=PARENTS):
    """SGLang's MambaMixer2 target-verify call (mamba.py), through the name it calls; returns out."""
    x = args["x"]
    out = torch.full_like(x, float("nan"))
    bs = x.shape[0]
    sglang_mamba2_mixer.selective_state_update(
        layer_cache.temporal, args["x"], args["dt"], args["A"], args["B"], args["C"], args["D"], z=None,
        dt_bias=args["dt_bias"], dt_softplus=True, state_batch_indices=CACHE_INDICES[:bs], out=out,
        disable_state_update=True, intermediate_states_buffer=layer_cache.intermediate_ssm, cache_steps=D,
        retrieve_parent_token=None if parents is None else parents.clone(),
        intermediate_state_indices=torch.arange(bs, dtype=torch.int32))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mamba2_tree_verify_and_commit_match_sglang(hooks, ssu_backend, cpu_scatter, dtype):
    """Three trees (:data:`PARENTS`, the third a padding request's) over two Mamba2 layers, activations in
    ``dtype``: outputs, each node's state from the records, and the committed states (accepted node
    and prefix-cache track node) against SGLang's selective_state_update and scatter."""
    from specla.mixers.mamba2.reference import node_states

    gen = torch.Generator().manual_seed(4)
    ours, sgl, init = _filled_pools("mamba2", gen, params=_mamba2_params())
    parents = PARENTS.clone()
    parents[:, 0] = -1
    layout = RecordLayout(H=MNG, HV=MH, K=MNS, V=MP)
    for layer in range(LAYERS):
        args = _mamba2_layer(gen, dtype=dtype)
        o_sgl, o_ours = (_mamba2_verify(pool.mamba2_layer_cache(layer), args) for pool in (sgl, ours))
        assert o_ours.dtype == o_sgl.dtype == dtype
        # the padding request's non-root outputs are not compared: SGLang's kernel reads their
        # parents' states from per-node rows it never wrote for that request (its root, from a zero
        # state, is)
        compared = torch.ones(3, D, dtype=torch.bool)
        compared[2, 1:] = False
        o_sgl, o_ours = o_sgl[compared].float(), o_ours[compared].float()
        # float32: the two kernels sum in different orders; bfloat16: one bfloat16 ulp
        tol = 4e-5 if dtype == torch.float32 else 2**-8 * o_sgl.abs() + 1e-6
        assert ((o_ours - o_sgl).abs() <= tol).all()
        assert torch.equal(ours.mamba_cache.temporal, init)  # the verify reads the pool, no more
        Bm, u, G, parent = (x[:3] for x in layout.views(ours.mamba_cache.intermediate_ssm[layer]))
        assert parent.eq(parents.float() if layer == 0 else 0).all()  # only the first layer's hold parents
        S0 = init[layer, CACHE_INDICES[:2].long()]
        from_records = node_states(S0.transpose(-1, -2), Bm[:2], u[:2], G[:2], inclusive_ancestor_mask(parents[:2]))
        torch.testing.assert_close(from_records.transpose(-1, -2), sgl.mamba_cache.intermediate_ssm[layer, :2], **TOL)
    _commit_both_and_compare(ours, sgl, init, MAMBA2_LAST)


def test_mamba2_kernel_gets_sglangs_metadata_and_pool(hooks, ssu_backend, monkeypatch):
    """What SGLang's mixer passes reaches specla's Mamba2 verify as it is: the layer's pool slice
    (same memory and strides), the slots, the parents, the draft count, the record rows, and the
    record blocks as views of the pool's record buffer; the commit gets the whole pool once."""
    from specla_sglang import kernel

    calls = []

    def spy(name, fn):
        def call(*args, **kwargs):
            calls.append((name, args, kwargs))
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(kernel, "mamba2_pool_verify", spy("verify", kernel.mamba2_pool_verify))
    monkeypatch.setattr(kernel, "mamba2_pool_commit", spy("commit", kernel.mamba2_pool_commit))
    monkeypatch.setattr(kernel, "gdn_pool_commit", spy("gdn commit", kernel.gdn_pool_commit))
    gen = torch.Generator().manual_seed(5)
    ours = _mamba2_pool("mamba2")
    pool, records = ours.mamba_cache.temporal, ours.mamba_cache.intermediate_ssm
    layer_cache = ours.mamba2_layer_cache(1)
    args = _mamba2_layer(gen)
    _mamba2_verify(layer_cache, args)
    (name, vargs, vkw), = calls
    assert name == "verify"
    assert vargs[0].data_ptr() == pool[1].data_ptr() and vargs[0].stride() == pool[1].stride()
    assert all(a is args[k] for a, k in zip(vargs[1:8], ("x", "dt", "A", "B", "C", "D", "dt_bias")))
    assert vargs[8] is True and torch.equal(vargs[9], CACHE_INDICES)
    assert vkw["cache_steps"] == D and torch.equal(vkw["retrieve_parent_token"], PARENTS)
    assert torch.equal(vkw["intermediate_state_indices"], torch.arange(3, dtype=torch.int32))
    start, end = records[1].data_ptr(), records[1].data_ptr() + records[1].nbytes
    assert all(start <= t.data_ptr() < end for t in vkw["records"])
    hybrid_linear_attn_backend.scatter_mamba_states_after_mtp_verify(
        ours.mamba_cache, CACHE_INDICES, MAMBA2_LAST, None, None)
    assert [c[0] for c in calls] == ["verify", "commit"]
    assert calls[1][1][0] is pool


def test_mamba2_chain_verify_on_records_matches_sglang(hooks, ssu_backend):
    """A chain (no retrieve_parent_token, as SGLang's dummy runs verify a tree pool's batch) on
    records: specla's verify too, matching SGLang's."""
    gen = torch.Generator().manual_seed(6)
    ours, sgl = _mamba2_pool("mamba2"), _mamba2_pool(None)
    init = torch.randn(SLOTS, MH, MP, MNS, generator=gen) * 0.3
    for pool in (ours, sgl):
        pool.mamba_cache.temporal[0].copy_(init)
    args = _mamba2_layer(gen, bs=2)
    o_sgl, o_ours = (_mamba2_verify(pool.mamba2_layer_cache(0), args, parents=None) for pool in (sgl, ours))
    assert ((o_ours - o_sgl).abs() <= 4e-5).all()
    parent = RecordLayout(H=MNG, HV=MH, K=MNS, V=MP).views(ours.mamba_cache.intermediate_ssm[0])[3]
    assert parent[:2].eq(torch.arange(-1, D - 1).float()).all()


def test_mamba2_verify_refuses_what_it_does_not_do(hooks):
    ours = _mamba2_pool("mamba2")
    args = _mamba2_layer(torch.Generator().manual_seed(7))
    layer_cache = ours.mamba2_layer_cache(0)
    with pytest.raises(ValueError, match=r"^specla's Mamba2 tree verify takes no z, does not update the state and "
                                         r"reads negative slots as padding; got z=None, disable_state_update=False, "
                                         r"pad_slot_id=-1$"):
        sglang_mamba2_mixer.selective_state_update(
            layer_cache.temporal, *(args[k] for k in ("x", "dt", "A", "B", "C", "D")), dt_bias=args["dt_bias"],
            dt_softplus=True, state_batch_indices=CACHE_INDICES, out=torch.empty_like(args["x"]),
            intermediate_states_buffer=layer_cache.intermediate_ssm, cache_steps=D,
            retrieve_parent_token=PARENTS, intermediate_state_indices=torch.arange(3, dtype=torch.int32))
