"""specla's speculative GDN path inside vLLM 0.34.0's layer against vLLM's own, on a CPU (Triton's
interpreter): vLLM's ``QwenGatedDeltaNetAttention`` and specla's subclass, the same weights, each
with the ``MambaSpec`` it gives vLLM (vLLM's: ``1 + num_spec`` state blocks a request; specla's: one)
and bound to a pool of that size by vLLM's ``bind_kv_cache``, run step after step on the same
inputs, with metadata built by vLLM's ``GDNAttentionMetadataBuilder`` (specla's builder subclass for
specla's layer) from the same batch. In float32, the whole layer runs as on vLLM's CUDA platform
(``forward_cuda``: projections, vLLM's custom op calling ``_forward_core``, gated norm, output
projection); in bfloat16, ``_forward_core`` on bfloat16 activations (the weights stay float32:
vLLM's conv kernel returns NaN on bfloat16 weights under the interpreter).

The steps mix what vLLM schedules: prefills (first chunks and a chunk continuing a sequence),
speculative chains of 4, 3, 2 and 1 token (a zero-draft row), ``num_accepted_tokens`` from 1 (no
draft accepted) to the whole chain, speculative rows turning into plain one-token decodes beside a
prefill chunk (vLLM's split decode and prefill path), one of them a request whose chain stayed
pending through a step it was not in, and a step of speculative and prefill rows together. vLLM's pool holds the state
after every chain position in its own slot (``spec_state_indices_tensor [N, num_spec + 1]``) and
the next step reads slot ``num_accepted_tokens - 1``; its non-speculative path reads slot 0
(vLLM's runner never sends a request there after a chain; vllm#39273 is this class of bug), so
before such a step the oracle moves the state vLLM's next speculative step would read into slot 0.
Outputs of every step and every request's final state are compared (states float32).

What runs is vLLM's GPU path on the CPU: its Triton kernels (conv windows, the chain kernel, the
one-token decode kernel, the prefill's gate preparation; the projections and the gated norm as vLLM
runs them on its CPU platform), with three stand-ins that both layers run
and that decide nothing between them, for kernels that cannot run here: the chunked prefill
(:func:`_serial_prefill`), and ``gather_initial_states`` / ``scatter_states`` (they assert a CUDA
or XPU tensor) as torch indexing.
"""

import importlib.util
import sys

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed: see integrations/vllm/README.md for the test environment",
                allow_module_level=True)

import vllm_env  # noqa: E402,F401  (the environment first: see its docstring)
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
import vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn as qwen_gdn  # noqa: E402
from vllm.config import SpeculativeConfig  # noqa: E402
from vllm.forward_context import ForwardContext, override_forward_context  # noqa: E402
from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder  # noqa: E402
from vllm.utils.torch_utils import set_default_torch_dtype  # noqa: E402

from specla_vllm.layer import (SpeclaGDNAttentionMetadata, SpeclaGDNAttentionMetadataBuilder,  # noqa: E402
                               SpeclaQwenGatedDeltaNetAttention)
from vllm_cases import HF_CONFIG, current_vllm_config  # noqa: E402

NUM_SPEC = 3
ROW = NUM_SPEC + 1  # vLLM's state slots a request: 1 + num_speculative_blocks; specla's layer: 1
REQUESTS = 3
HV, V, K = 4, 16, 16


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def vllm_config(request):
    """3 speculative tokens (n-gram: no draft model to load); activations (and conv windows) in
    float32 or bfloat16."""
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=NUM_SPEC, prompt_lookup_max=3, prompt_lookup_min=1)
    with current_vllm_config(request.param, spec) as config:
        config.cache_config.mamba_block_size = 16  # what the layer's MambaSpec reads; any block size
        yield config


@triton.jit
def _exp(x):
    return tl.exp(x)


@triton.jit
def _log(x):
    return tl.log(x)


@pytest.fixture(scope="module")
def interpreter_fixes():
    """What vLLM's Triton kernels need to run under Triton's interpreter: their grid functions'
    argument swaps seen, integer masks read as bool (below), and the ``exp``/``log`` module aliases
    of Triton builtins in vLLM's FLA kernel files, which the interpreter does not patch, called
    through ``@triton.jit`` functions of the same builtin. Nothing changes what a kernel computes."""
    # vLLM's conv prefill grid function swaps tensor arguments (batch_ptr); compiled Triton launches
    # with the swapped ones, the interpreter converted its arguments before calling the grid
    from triton.runtime import interpreter

    init = interpreter.GridExecutor.__init__

    def grid_init(self, fn, arg_names, grid, *rest, **kw):
        if callable(grid):
            def swapped(args, grid=grid):
                shape = grid(args)
                for name, value in args.items():
                    if isinstance(value, torch.Tensor):
                        args[name] = interpreter._implicit_cvt(value)
                return shape

            init(self, fn, arg_names, swapped, *rest, **kw)
        else:
            init(self, fn, arg_names, grid, *rest, **kw)

    class MasksAsBool:
        """The interpreter's C++ load and store refuse the integer mask its ``&`` of a scalar and a
        block comparison yields (vLLM's conv kernels); the same 0/1 mask as bool."""

        def __getattr__(self, name):
            return getattr(native, name)

        def load(self, ptrs, mask, other, dtype):
            return native.load(ptrs, mask.astype(bool), other, dtype)

        def store(self, ptrs, value, mask):
            return native.store(ptrs, value, mask.astype(bool))

    native = interpreter._interpreter
    wrappers = {"exp": (tl.exp, _exp), "log": (tl.log, _log)}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(interpreter.GridExecutor, "__init__", grid_init)
        mp.setattr(interpreter, "_interpreter", MasksAsBool())
        for name, mod in list(sys.modules.items()):
            if name.startswith("vllm.third_party.flash_linear_attention.ops."):
                for alias, (builtin, wrapper) in wrappers.items():
                    if getattr(mod, alias, None) is builtin:
                        mp.setattr(mod, alias, wrapper)
        yield


def _serial_prefill(self, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens=None, **_):
    """A torch stand-in for vLLM's chunked prefill (``ChunkGatedDeltaRule``), whose FLA kernels do not
    run under Triton's interpreter as they are (their autotuning benchmarks on a GPU driver; with the
    repository's FLA-oracle workarounds they returned outputs of order 1e8 where this recurrence
    gives 0.1): the serial gated delta rule in float32 from each sequence's initial
    state, q and k already normalised (vLLM's prep does it). Shapes as vLLM's: ``q, k [1, T, H, K]``,
    ``v [1, T, HV, V]``, ``g, beta [1, T, HV]``, ``initial_state [N, HV, V, K]``; returns ``o``
    (``v``'s shape and dtype) and the final states."""
    H, K, HV = q.shape[2], q.shape[3], v.shape[2]
    o = torch.empty_like(v)
    final = initial_state.clone().float()
    for n in range(cu_seqlens.shape[0] - 1):
        S = final[n]
        for t in range(int(cu_seqlens[n]), int(cu_seqlens[n + 1])):
            kt, qt = (x[0, t].float().repeat_interleave(HV // H, 0) for x in (k, q))
            S = S * g[0, t].float().exp()[:, None, None]
            delta = (v[0, t].float() - (S @ kt[..., None])[..., 0]) * beta[0, t].float()[:, None]
            S = S + delta[..., None] * kt[:, None, :]
            o[0, t] = ((S @ qt[..., None])[..., 0] * K**-0.5).to(o.dtype)
        final[n] = S
    return o, final.to(initial_state.dtype)


@pytest.fixture(scope="module")
def gpu_ops_on_cpu():
    """vLLM's GPU path on the CPU: its Triton conv kernels (vLLM's CPU platform binds
    ``causal_conv1d_fn``/``_update`` to compiled CPU ops instead; the module is loaded again from its
    file with the platform's ``is_cpu`` answering False), and ``gather_initial_states`` /
    ``scatter_states``, which assert a CUDA or XPU tensor, as the same torch indexing (a gather of
    the slots, a zero state where there is no initial state; a scatter). Both layers run them."""
    import vllm.model_executor.layers.mamba.ops.causal_conv1d as conv_module
    from vllm.platforms import current_platform

    import specla_vllm.layer

    def gather(state, indices, has_initial_state):
        return torch.where(has_initial_state.view(-1, *[1] * (state.dim() - 1)), state[indices.long()], 0)

    def scatter(state, src, indices):
        state[indices.long()] = src.to(state.dtype)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(current_platform), "is_cpu", lambda self: False)
        spec = importlib.util.spec_from_file_location("vllm_causal_conv1d_triton", conv_module.__file__)
        triton_conv = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(triton_conv)
        mp.undo()
        for module in (qwen_gdn, specla_vllm.layer):
            mp.setattr(module, "causal_conv1d_update", triton_conv.causal_conv1d_update)
        mp.setattr(qwen_gdn, "causal_conv1d_fn", triton_conv.causal_conv1d_fn)
        mp.setattr(qwen_gdn.ChunkGatedDeltaRule, "forward_native", _serial_prefill)
        mp.setattr(qwen_gdn, "gather_initial_states", gather)
        mp.setattr(qwen_gdn, "scatter_states", scatter)
        yield


_layers = iter(range(1_000))


def _layer(cls, config, seed: int):
    """A ``cls`` layer with random weights drawn from ``seed``, loaded as vLLM's loader leaves them;
    specla's runs its GPU path (``_forward_core``, as on vLLM's CUDA platform) where the test calls it."""
    gen = torch.Generator().manual_seed(seed)
    with set_default_torch_dtype(torch.float32):  # vLLM's conv kernel gives NaN on bfloat16 weights when interpreted
        layer = cls(HF_CONFIG, config, prefix=f"model.layers.{next(_layers)}.linear_attn")
    assert type(layer) is cls
    if cls is SpeclaQwenGatedDeltaNetAttention:
        layer._forward_method = layer.forward_cuda
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    # vLLM's loader's last step, on the projections: on vLLM's CPU platform, their matmuls; vLLM's
    # plain one (torch's linear), its packed ones needing vLLM's compiled CPU ops
    for module in (layer.in_proj_qkvz, layer.in_proj_ba, layer.out_proj):
        module._cpu_skip_gemm_dispatch = True
        module.quant_method.process_weights_after_loading(module)
    return layer


def _pair(config):
    """vLLM's layer and specla's, the same random weights, each with the ``MambaSpec`` it gives vLLM
    and bound by vLLM's ``bind_kv_cache`` to zeroed pages of a pool holding :data:`REQUESTS`
    requests as vLLM sizes it from that spec (slot 0: vLLM's null block)."""
    ref, ours = (_layer(cls, config, 0) for cls in (qwen_gdn.QwenGatedDeltaNetAttention, SpeclaQwenGatedDeltaNetAttention))
    specs = [layer.get_kv_cache_spec(config) for layer in (ref, ours)]
    for layer, spec in zip((ref, ours), specs):
        blocks = 1 + REQUESTS * spec.max_num_blocks_per_req(config, 0)
        layer.bind_kv_cache(torch.zeros(blocks, 1, 1, spec.page_size_bytes, dtype=torch.int8))
    return ref, ours, specs


def _block_table(rows: list[int], width: int) -> torch.Tensor:
    """vLLM's block table of the step's requests, ``width`` state blocks a request (request ``r``:
    blocks ``1 + r * width`` on)."""
    return torch.tensor([[1 + r * width + j for j in range(width)] for r in rows], dtype=torch.int32)


def _common(rows, qlens, seq_lens, prefilling, width):
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq, num_reqs=len(rows),
        num_actual_tokens=int(qsl[-1]), max_query_len=max(qlens), max_seq_len=int(seq.max()),
        block_table_tensor=_block_table(rows, width), slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64),
        is_prefilling=torch.tensor(prefilling), seq_lens_cpu_upper_bound=seq.clone())


# the steps: (request, kind, tokens, accepted at the request's previous step); speculative and plain
# decode rows first, as vLLM's runner orders a batch; "spec" rows verify a chain of `tokens`
STEPS = [
    [(0, "prefill", 5, 1), (1, "prefill", 3, 1)],
    [(0, "spec", 4, 1), (1, "spec", 4, 1), (2, "prefill", 6, 1)],  # speculative and prefill rows together
    [(0, "spec", 4, 3), (1, "spec", 1, 4), (2, "spec", 2, 1)],  # a zero-draft row after a whole chain
    [(0, "spec", 1, 2), (1, "spec", 4, 1), (2, "spec", 4, 2)],
    [(0, "spec", 3, 1), (2, "spec", 4, 3)],  # request 1's chain stays pending a step
    # chains' requests decode plainly, and request 1's continues as a prefill chunk
    [(0, "decode", 1, 2), (2, "decode", 1, 4), (1, "chunk", 3, 3)],
    [(0, "spec", 4, 1), (1, "spec", 2, 1), (2, "spec", 3, 1)],
]
FINAL_ACCEPTED = [2, 2, 1]  # what the last step's rows accept, committed at the end


def _forward(layer, metadata, hidden):
    """The layer's forward on ``hidden [tokens, hidden_size]`` as vLLM's CUDA platform runs it
    (``forward_cuda``: projections, vLLM's ``qwen_gdn_attention_core`` custom op calling the layer's
    ``_forward_core``, gated norm, output projection), under a forward context holding ``metadata``;
    returns ``[tokens, hidden_size]`` in float32."""
    ctx = ForwardContext(no_compile_layers={layer.prefix: layer}, attn_metadata={layer.prefix: metadata},
                         slot_mapping={})
    with override_forward_context(ctx), torch.inference_mode():
        return layer.forward_cuda(hidden).float()


def _run(layer, metadata, mixed_qkv, ba):
    """``layer._forward_core`` on copies of the step's inputs (vLLM's conv kernels write theirs), the
    gates ``b, a`` strided halves of ``ba`` as vLLM splits them, under a forward context holding
    ``metadata``; returns the core output ``[tokens, HV, V]`` in float32."""
    out = torch.full((mixed_qkv.shape[0], HV, V), float("nan"), dtype=mixed_qkv.dtype)
    ctx = ForwardContext(no_compile_layers={}, attn_metadata={layer.prefix: metadata}, slot_mapping={})
    with override_forward_context(ctx):
        layer._forward_core(mixed_qkv.clone(), *ba.clone().chunk(2, dim=-1), out)
    return out.float()


def _slot(r: int, j: int = 0, width: int = ROW) -> int:
    return 1 + r * width + j


def test_specla_layer_charges_vllms_pool_one_state_block_a_request(vllm_config):
    ref, ours, (ref_spec, spec) = _pair(vllm_config)
    assert (ref_spec.num_speculative_blocks, spec.num_speculative_blocks) == (NUM_SPEC, 0)
    assert spec.page_size_bytes == ref_spec.page_size_bytes
    assert ref_spec.max_memory_usage_bytes(vllm_config) == ROW * spec.max_memory_usage_bytes(vllm_config)
    assert (ref.kv_cache[1].shape[0], ours.kv_cache[1].shape[0]) == (1 + REQUESTS * ROW, 1 + REQUESTS)
    records, pending = ours.slot_records
    assert (records.k.shape, records.delta.shape, records.G.shape) == (
        (1 + REQUESTS, ROW, 2, K), (1 + REQUESTS, ROW, HV, V), (1 + REQUESTS, ROW, HV))
    assert pending.dtype == torch.int32 and not pending.any()
    assert ours.get_attn_backend().get_builder_cls() is SpeclaGDNAttentionMetadataBuilder
    assert ours.get_attn_backend().get_name() == ref.get_attn_backend().get_name() == "GDN_ATTN"


def test_specla_spec_path_equals_vllms_over_mixed_steps(vllm_config, interpreter_fixes, gpu_ops_on_cpu):
    ref, ours, specs = _pair(vllm_config)
    builders = [cls(spec, [layer.prefix], vllm_config, torch.device("cpu")) for cls, layer, spec in
                zip((GDNAttentionMetadataBuilder, SpeclaGDNAttentionMetadataBuilder), (ref, ours), specs)]
    gen = torch.Generator().manual_seed(1)
    seq_len = [0] * REQUESTS
    last_chain = [0] * REQUESTS  # tokens of each request's last chain, 0 after a prefill or decode
    for step in STEPS:
        rows = [r for r, *_ in step]
        for r, kind, n, accepted in step:
            if kind != "spec" and last_chain[r] and accepted > 1:
                # vLLM's non-speculative path reads slot 0; its chain left the state in slot accepted - 1
                ref.kv_cache[1][_slot(r)] = ref.kv_cache[1][_slot(r, accepted - 1)]
            seq_len[r] += n - (last_chain[r] - accepted if last_chain[r] else 0)
            last_chain[r] = n if kind == "spec" else 0
        accepted = torch.tensor([a for *_, a in step], dtype=torch.int32)
        drafts = torch.tensor([n - 1 if kind == "spec" else -1 for _, kind, n, _ in step], dtype=torch.int32)
        meta = [b.build(0, _common(rows, [n for _, _, n, _ in step], [seq_len[r] for r in rows],
                                   [kind in ("prefill", "chunk") for _, kind, _, _ in step], width),
                        num_accepted_tokens=accepted, num_decode_draft_tokens_cpu=drafts)
                for b, width in zip(builders, (ROW, 1))]
        assert type(meta[1]) is SpeclaGDNAttentionMetadata
        T, dtype = meta[0].num_actual_tokens, vllm_config.model_config.dtype
        if dtype == torch.float32:  # the whole layer, vLLM's CUDA forward
            hidden = torch.randn(T, HF_CONFIG.hidden_size, generator=gen)
            o_ref, o = (_forward(layer, m, hidden) for layer, m in zip((ref, ours), meta))
            tol = 2e-6 * o_ref.abs().max()  # observed up to 1.8e-7 of the step's largest output (up to 64)
        else:  # bfloat16 activations into the core (the weights stay float32)
            mixed_qkv = torch.randn(T, ref.conv_dim, generator=gen).to(dtype)
            ba = torch.randn(T, 2 * HV, generator=gen).to(dtype)
            o_ref, o = (_run(layer, m, mixed_qkv, ba) for layer, m in zip((ref, ours), meta))
            tol = 2**-8 * o_ref.abs()  # one bf16 ulp; observed equal
        assert ((o - o_ref).abs() <= tol).all()
        # pending chains: the speculative rows' just verified, every other row's committed
        assert [ours.slot_records.pending[_slot(r, width=1)].item() for r in range(REQUESTS)] == last_chain

    # the last chains, committed as vLLM's next step would read them
    ours.commit_pending(torch.tensor([_slot(r, width=1) for r in range(REQUESTS)], dtype=torch.int32),
                        torch.tensor(FINAL_ACCEPTED, dtype=torch.int32))
    assert not ours.slot_records.pending.any()
    states = ours.kv_cache[1][[_slot(r, width=1) for r in range(REQUESTS)]]
    ref_states = torch.stack([ref.kv_cache[1][_slot(r, a - 1)] for r, a in enumerate(FINAL_ACCEPTED)])
    # observed 4.8e-7 with states up to 8.1 (float32), 1.2e-7 up to 1.4 (bfloat16): up to 8.3e-8 of the largest
    assert (states - ref_states).abs().max() < 1e-6 * ref_states.abs().max()
    # the conv windows are vLLM's code in both, each request's in its first slot: equal
    assert torch.equal(ours.kv_cache[0][1:], ref.kv_cache[0][[_slot(r) for r in range(REQUESTS)]])


def test_non_speculative_rows_without_accepted_counts_are_refused(vllm_config):
    ref, ours, (spec, _) = _pair(vllm_config)
    builder = GDNAttentionMetadataBuilder(spec, [ours.prefix], vllm_config, torch.device("cpu"))
    prefill = builder.build(0, _common([0], [3], [3], [True], 1), num_accepted_tokens=torch.ones(1, dtype=torch.int32),
                            num_decode_draft_tokens_cpu=torch.tensor([-1], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"^a step with non-speculative rows needs SpeclaGDNAttentionMetadata\."
                                         r"non_spec_num_accepted_tokens \(vLLM gave no num_accepted_tokens to "
                                         r"the builder\)$"):
        _run(ours, prefill, torch.zeros(3, ref.conv_dim), torch.zeros(3, 2 * HV))


def test_mamba_prefix_caching_with_specla_chains_is_refused(vllm_config, monkeypatch):
    """Built as on vLLM's CUDA platform (the layer then runs specla's chains)."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(vllm_config.cache_config, "mamba_cache_mode", "align")
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    with pytest.raises(ValueError, match=r"^specla-vllm's GDN layer does not support mamba_cache_mode='align' with "
                                         r"speculative decoding: its prefix-cache block copies read vLLM's "
                                         r"per-position state slots$"):
        SpeclaQwenGatedDeltaNetAttention(HF_CONFIG, vllm_config, prefix=f"model.layers.{next(_layers)}.linear_attn")


# two layers' steps, each row (block, kind, tokens, accepted at the request's previous step): the
# blocks split between the layers, as vLLM's block pool splits them between its cache groups
SHARED_STEPS = [
    ([(1, "prefill", 5, 1), (2, "prefill", 3, 1)], [(3, "prefill", 4, 1)]),
    ([(1, "spec", 4, 1), (2, "spec", 4, 1)], [(3, "spec", 3, 1)]),
    # block 2's request ends with its chain pending; the block goes to a new request of the other layer
    ([(1, "spec", 4, 2)], [(3, "spec", 4, 3), (2, "prefill", 3, 1)]),
    ([(1, "spec", 2, 4)], [(3, "spec", 4, 2), (2, "spec", 4, 1)]),
]
SHARED_FINAL = ([(1, 2)], [(3, 3), (2, 1)])  # (block, accepted) of the last chains, committed at the end


def test_layers_over_the_same_pages_share_records_and_compute_as_apart(vllm_config, interpreter_fixes,
                                                                       gpu_ops_on_cpu):
    """Two specla layers bound to views of one allocation, as vLLM binds one layer of each cache
    group (``KVCacheTensor.shared_by``), share one record buffer; stepped with the blocks split
    between them, and a block freed by one with its chain pending given to a new request of the
    other, their outputs, states and conv windows equal, bit for bit, those of the same layers over
    pages and records of their own."""
    shared, apart = ([_layer(SpeclaQwenGatedDeltaNetAttention, vllm_config, seed) for seed in (2, 3)] for _ in range(2))
    spec, blocks = shared[0].get_kv_cache_spec(vllm_config), 4
    pages = torch.zeros(blocks, 1, 1, spec.page_size_bytes, dtype=torch.int8)
    for layer in shared:
        layer.bind_kv_cache(pages.view(blocks, 1, 1, -1))
    for layer in apart:
        layer.bind_kv_cache(torch.zeros_like(pages))
    assert shared[0].slot_records is shared[1].slot_records
    assert apart[0].slot_records is not apart[1].slot_records
    packed = [_layer(SpeclaQwenGatedDeltaNetAttention, vllm_config, 5) for _ in range(2)]
    both = torch.zeros(blocks, 2, spec.page_size_bytes, dtype=torch.int8)  # two layers' pages in one allocation
    for i, layer in enumerate(packed):
        layer.bind_kv_cache(both[:, i, None, None])
    assert packed[0].slot_records is not packed[1].slot_records
    builder = SpeclaGDNAttentionMetadataBuilder(spec, [shared[0].prefix], vllm_config, torch.device("cpu"))
    gen = torch.Generator().manual_seed(4)
    dtype = vllm_config.model_config.dtype
    seq_len, last_chain = [0] * blocks, [0] * blocks
    for step in SHARED_STEPS:
        for which, rows in enumerate(step):
            for b, kind, n, accepted in rows:
                if kind == "prefill":  # a new request in block b
                    seq_len[b], last_chain[b] = 0, 0
                seq_len[b] += n - (last_chain[b] - accepted if last_chain[b] else 0)
                last_chain[b] = n if kind == "spec" else 0
            T = sum(n for _, _, n, _ in rows)
            mixed_qkv = torch.randn(T, shared[0].conv_dim, generator=gen).to(dtype)
            ba = torch.randn(T, 2 * HV, generator=gen).to(dtype)
            outs = []
            for layer in (shared[which], apart[which]):
                meta = builder.build(0, _common([b - 1 for b, *_ in rows], [n for _, _, n, _ in rows],
                                                [seq_len[b] for b, *_ in rows],
                                                [kind == "prefill" for _, kind, _, _ in rows], 1),
                                     num_accepted_tokens=torch.tensor([a for *_, a in rows], dtype=torch.int32),
                                     num_decode_draft_tokens_cpu=torch.tensor(
                                         [n - 1 if kind == "spec" else -1 for _, kind, n, _ in rows], dtype=torch.int32))
                outs.append(_run(layer, meta, mixed_qkv, ba))
            assert not outs[0].isnan().any() and torch.equal(*outs)
    for which, rows in enumerate(SHARED_FINAL):
        at = torch.tensor([b for b, _ in rows], dtype=torch.int32)
        for layer in (shared[which], apart[which]):
            layer.commit_pending(at, torch.tensor([a for _, a in rows], dtype=torch.int32))
        for i in (0, 1):  # the recurrent states, the conv windows
            assert torch.equal(shared[which].kv_cache[i][at.long()], apart[which].kv_cache[i][at.long()])
    assert not shared[0].slot_records.pending.any()
