"""CUDA graphs (:mod:`specla.cuda`) on a GPU: recorded steps are token-identical to eager
steps, with one host synchronisation per recorded step. Skipped without CUDA; the same
fixed-shape step (unrecorded) runs on the CPU in the conformance suite
(``test_cuda_graph_step_token_identical_or_refused``) and below."""

import gc
import warnings
from pathlib import Path

import pytest
import torch

from specla import DraftTree, NonFiniteLogitsError, SpecConfig
from specla.api import SpecDecoder
from specla.drafters.ngram import NgramDrafter
from specla.errors import ConfigError
from conftest import EVERY_TOKEN, poison_logits

ASSETS = Path(__file__).resolve().parents[2] / "plugins" / "fla" / "assets"
TREES = {"chain": dict(num_draft_tokens=6, max_depth=6, top_k=1), "tree": dict(num_draft_tokens=16, max_depth=6, top_k=4)}
OFF = dict(cuda_graphs="off")  # eager steps
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def prompts_and_stops(n: int):
    """``n`` random prompts and stop tokens taken from their greedy outputs at different
    positions, so that the sequences end at different steps."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 8000, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    ar = SpecDecoder(ASSETS / "tiny", drafter="ngram", config=dict(num_draft_tokens=0, max_new_tokens=40,
                                                                  dtype="float32", engine=OFF)).generate(prompts)
    return prompts, tuple(sorted({o[min(3 * i, len(o) - 1)] for i, o in enumerate(ar.outputs)}))


def run(device: str, drafter: str, tree: str, graphs: str, prompts, stops):
    cfg = dict(device=device, dtype="float32", max_new_tokens=40, stop_token_ids=stops,
               engine=dict(cuda_graphs=graphs, budget_policy="fixed"), **TREES[tree])
    dec = SpecDecoder(ASSETS / "tiny", drafter=str(ASSETS / "tiny-eagle") if drafter == "eagle" else "ngram", config=cfg)
    return dec, dec.generate(prompts)


@cuda
@pytest.mark.parametrize("drafter", ["ngram", "eagle"])
@pytest.mark.parametrize("tree", ["chain", "tree"])
def test_recorded_steps_token_identical(drafter, tree):
    """13 sequences (16 graph rows) ending at different steps: recorded CUDA graphs (for the
    batches the live rows are gathered into) give the eager output, twice (the second call
    replays the graphs of the first)."""
    prompts, stops = prompts_and_stops(13)
    _, eager = run("cuda", drafter, tree, "off", prompts, stops)
    dec, graphed = run("cuda", drafter, tree, "on", prompts, stops)
    assert len({len(o) for o in eager.outputs}) >= 3  # sequences really end at different steps
    assert graphed.outputs == eager.outputs
    runner = dec.engine._runner
    assert runner.graphs and all(g.graph is not None for g in runner.graphs.values())
    assert dec.generate(prompts).outputs == eager.outputs


@cuda
@pytest.mark.parametrize("drafter", ["ngram", "eagle"])
def test_one_host_synchronisation_per_recorded_step(drafter):
    """Once recorded, a step synchronises with the host once (reading its outcome): counted
    with ``torch.cuda.set_sync_debug_mode("warn")`` around every replayed step."""
    prompts, stops = prompts_and_stops(4)
    dec, _ = run("cuda", drafter, "tree", "on", prompts, stops)
    runner, counts = dec.engine._runner, []
    step = runner.step

    def counted(*args):  # runner.step(contexts, uniforms)
        if dec.adapter.graph_state() is None or dec.adapter.batch_size not in runner.graphs:
            return step(*args)  # the first step after a prefill, or a batch not recorded yet
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                result = step(*args)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        # only the synchronisation warnings themselves: the first set_sync_debug_mode call of a
        # process also warns that the mode is a prototype, which must not count
        counts.append(sum("called a synchronizing CUDA operation" in str(w.message) for w in seen))
        return result

    runner.step = counted
    dec.generate(prompts)
    assert counts and max(counts) == 1


def test_cuda_graphs_on_refuses_a_budget_over_the_recorded_verify():
    """``cuda_graphs="on"`` / ``"unrecorded"`` with a budget over the recorded verify's limit
    (Triton kernels: 63 draft nodes) raises a ConfigError when the decoder is built."""
    cuda_ok = torch.cuda.is_available()
    with pytest.raises(ConfigError, match="63"):
        SpecDecoder(ASSETS / "tiny", config=dict(engine=dict(cuda_graphs="on" if cuda_ok else "unrecorded",
                                                             kernels="triton"),
                                                 num_draft_tokens=64, max_depth=8, dtype="float32",
                                                 device="cuda" if cuda_ok else "cpu"))


def test_cuda_graphs_on_needs_a_cuda_device():
    """``cuda_graphs="on"`` on a CPU model raises a ConfigError naming the device and the
    ``unrecorded`` alternative, when the decoder is built (nothing runs)."""
    with pytest.raises(ConfigError, match=r"cuda_graphs='on' needs a CUDA device; the model runs on cpu "
                                          r"\(cuda_graphs='unrecorded'"):
        SpecDecoder(ASSETS / "tiny", config=dict(engine=dict(cuda_graphs="on"), device="cpu"))


class _Padded(NgramDrafter):
    """An ngram drafter whose trees carry padding columns past the budget (valid: num_nodes <= N)."""

    name = "padded"

    def propose(self, contexts, config):
        t = super().propose(contexts, config)
        pad = config.num_draft_tokens + 3 - t.width
        B = t.batch_size
        return DraftTree(torch.cat([t.tokens, torch.zeros(B, pad, dtype=torch.int64)], 1),
                         torch.cat([t.parents, torch.full((B, pad), -1, dtype=torch.int64)], 1), t.num_nodes)


class _Nothing(NgramDrafter):
    name = "nothing"

    def propose(self, contexts, config):
        return None


def test_host_drafters_behave_the_same_with_and_without_graphs():
    """Host trees wider than the budget (padding only), a drafter returning None (no drafts) and
    one returning a list (TypeError) are treated alike by the recorded step and the eager one."""
    prompts = [[5, 6, 7, 5, 6, 7, 5], [9, 8, 9, 8]]
    for drafter in (_Padded, _Nothing):
        out = {}
        for graphs in ("off", "unrecorded"):
            cfg = dict(dtype="float32", num_draft_tokens=4, max_depth=4, max_new_tokens=12,
                       engine=dict(cuda_graphs=graphs))
            out[graphs] = SpecDecoder(ASSETS / "tiny", drafter=drafter(), config=cfg).generate(prompts)
        assert out["unrecorded"].outputs == out["off"].outputs
        assert out["unrecorded"].stats.accepted_histogram == out["off"].stats.accepted_histogram

    class Listy(NgramDrafter):
        name = "listy"

        def propose(self, contexts, config):
            return []

    for graphs in ("off", "unrecorded"):
        dec = SpecDecoder(ASSETS / "tiny", drafter=Listy(), config=dict(engine=dict(cuda_graphs=graphs),
                                                                         num_draft_tokens=4))
        with pytest.raises(TypeError, match="listy"):
            dec.generate(prompts)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
@pytest.mark.parametrize("plugin", ["gla", "mamba2", "qwen"])
@pytest.mark.parametrize("commit,budget", [("factor", 6), ("snapshot", 6), ("factor", 0)])
def test_fixed_shape_step_of_gla_mamba2_and_qwen(plugin, commit, budget, device):
    """The GLA, Mamba2 and Qwen3.5 adapters' graph state (``ModelAdapter``): the engine with
    ``cuda_graphs="unrecorded"`` on the CPU and ``"on"`` on CUDA equals eager decoding, with
    sequences stopping at different steps, with drafts and without (one-token steps: the serial
    kernels inside the graph on CUDA); their plugins declare ``cuda_graphs``, so
    ``SpecDecoder`` accepts them."""
    from specla.drafters.ngram import NgramDrafter
    from specla.engine import Engine
    from specla.registry import get_plugin

    arch = get_plugin(plugin)
    model = arch.tiny_model(arch.tiny_variants[0], seed=1)
    V = model.get_input_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(2)
    motif = torch.randint(0, V, (5,), generator=g).tolist()
    prompts = [motif * 3, torch.randint(0, V, (9,), generator=g).tolist(), [motif[0]], motif * 2 + [1]]
    ref = SpecDecoder(model, plugin, config=dict(num_draft_tokens=0, max_new_tokens=20, engine=OFF,
                                                 device=device, dtype="float32"))
    stops = tuple(sorted({o[min(4 * i, len(o) - 1)] for i, o in enumerate(ref.generate(prompts).outputs)}))
    outs = {}
    on = "on" if device == "cuda" else "unrecorded"
    for graphs in ("off", on):
        cfg = SpecConfig(num_draft_tokens=budget, max_depth=4, top_k=2, max_new_tokens=20, stop_token_ids=stops,
                         engine=dict(commit=commit, cuda_graphs=graphs), device=device, dtype="float32")
        adapter = arch.make_adapter(model, cfg)
        drafter = NgramDrafter()
        drafter.bind(adapter)
        engine = Engine(adapter, drafter, cfg)
        outs[graphs] = engine.generate(prompts)[0]
        if device == "cuda" and graphs == "on":
            assert engine._runner is not None and engine._runner.graphs, "no step was recorded"
    assert outs[on] == outs["off"]
    assert len({len(o) for o in outs["off"]}) >= 2
    assert SpecDecoder(model, plugin, config=dict(engine=dict(cuda_graphs="unrecorded"))).engine is not None


@pytest.mark.parametrize("drafter,tree", [("eagle", "tree"), ("eagle", "chain"), ("ngram", "none")])
def test_bound_steps_and_release(drafter, tree):
    """Steps that replay on the bound graph without reloading the state (``GraphRunner.step``
    while bound; the engine releases it after a prefill or a gather), here unrecorded on the CPU:
    13 sequences ending at different steps (stop tokens, then gathers into smaller batches) give
    eager decoding's outputs and acceptance histogram, with a device-side drafter, and with no
    budget (an empty tree built on the device); a second call with other prompts (a new prefill
    into the same graphs) does too."""
    prompts, stops = prompts_and_stops(13)
    trees = dict(TREES, none=dict(num_draft_tokens=0))

    def decoder(graphs):
        cfg = dict(device="cpu", dtype="float32", max_new_tokens=40, stop_token_ids=stops,
                   engine=dict(cuda_graphs=graphs), **trees[tree])
        return SpecDecoder(ASSETS / "tiny", drafter=str(ASSETS / "tiny-eagle") if drafter == "eagle" else "ngram",
                           config=cfg)

    eager, graphed = decoder("off"), decoder("unrecorded")
    for batch in (prompts, prompts[3:11][::-1]):
        want, got = eager.generate(batch), graphed.generate(batch)
        assert got.outputs == want.outputs
        assert got.stats.accepted_histogram == want.stats.accepted_histogram
        assert len({len(o) for o in want.outputs}) >= 3
    assert graphed.engine._runner.graphs


def test_copy_into_copies_every_replaced_tensor():
    """The recorded step's closing copy: dense pairs of several dtypes (multi-tensor copies),
    a strided source, a dtype change, and a tensor that is its own static copy (left alone)."""
    from specla.cuda.capture import copy_into

    g = torch.Generator().manual_seed(3)
    same = torch.randn(3, generator=g)
    wide = torch.randn(4, 6, generator=g)
    new = [torch.randn(2, 3, generator=g), torch.randint(0, 9, (5,), generator=g), wide[:, :2], same,
           torch.randn(4, generator=g)]
    static = [torch.full((2, 3), float("nan")), torch.full((5,), -1), torch.full((4, 2), float("nan")), same,
              torch.full((4,), float("nan"), dtype=torch.float64)]
    before = same.clone()
    copy_into(static, new)
    for dst, src in zip(static, new):
        assert torch.equal(dst, src.to(dst.dtype))
    assert torch.equal(same, before)


def test_copy_into_copies_a_one_row_slice_in_the_multi_tensor_copy():
    """At batch 1 and one token a projection's column slice ``[1, 1, D]`` is dense for torch but
    has other strides than its dense static buffer: ``copy_into`` copies it exactly, inside the
    one multi-tensor copy (no ``copy_`` of its own, which is a kernel per layer in the step)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from specla.cuda.capture import copy_into

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(8)
    proj = torch.randn(1, 1, 10, generator=g)
    new = [proj[..., 2:8], torch.randn(2, 3, generator=g)]
    static = [torch.full((1, 1, 6), float("nan")), torch.full((2, 3), float("nan"))]
    assert new[0].stride() != static[0].stride() and new[0].is_contiguous()
    with Ops() as ops:
        copy_into(static, new)
    for dst, src in zip(static, new):
        assert torch.equal(dst, src)
    assert "copy_" not in ops.names and ops.names.count("_foreach_copy_") == 1


def test_static_like_keeps_a_slice_of_whole_rows_and_clones_the_rest():
    """``static_like``: a column slice of a fused projection (at columns 0, in the middle, at the
    end) gets a new buffer of whole rows with the slice's strides and values, and ``copy_into``
    fills it exactly from another projection's slice; a broadcast (stride 0) or transposed view
    is cloned (a dense buffer of its own)."""
    from specla.cuda.capture import copy_into, static_like

    g = torch.Generator().manual_seed(6)
    z, z2 = torch.randn(2, 3, 10, generator=g), torch.randn(2, 3, 10, generator=g)
    for cols in (slice(0, 6), slice(6, 8), slice(8, 10)):
        s = static_like(z[..., cols])
        assert s.stride() == z[..., cols].stride() and torch.equal(s, z[..., cols])
        assert s.untyped_storage().data_ptr() != z.untyped_storage().data_ptr()
        copy_into([s], [z2[..., cols]])
        assert torch.equal(s, z2[..., cols])
    for odd in (torch.randn(2, 1, 4, generator=g).expand(2, 3, 4), z.transpose(0, 1)[..., :4]):
        s = static_like(odd)
        assert torch.equal(s, odd) and s.untyped_storage().nbytes() == s.numel() * s.element_size()  # a clone


def test_runner_notices_a_state_replaced_outside_it():
    """A ``select`` outside the runner (no ``release``) replaces the adapter's roots: the next
    step reloads the state instead of replaying on the stale buffers, so it gives the same
    outcome as a runner that was released (unrecorded, on the CPU)."""
    prompts = [[5, 6, 7, 5, 6, 7, 5], [9, 8, 9, 8, 3]]
    outcomes = []
    for release in (True, False):
        cfg = dict(dtype="float32", num_draft_tokens=4, max_depth=4, max_new_tokens=12,
                   engine=dict(cuda_graphs="unrecorded"))
        dec = SpecDecoder(ASSETS / "tiny", drafter="ngram", config=cfg)
        dec.generate(prompts)  # the runner's graph for this batch exists
        runner, ad, dr = dec.engine._runner, dec.adapter, dec.drafter
        ad.prefill(prompts)
        dr.reset(prompts)
        runner.release()
        contexts = [list(p) for p in prompts]
        for _ in range(2):  # a step from the empty commit, then one on the bound buffers
            num, drafted, bonus, _ = runner.step(contexts)
            for c, n, d, b in zip(contexts, num, drafted, bonus):
                c += d[:n] + [b]
        swap = torch.tensor([1, 0])
        ad.select(swap)
        dr.select(swap)
        if release:
            runner.release()
        outcomes.append(runner.step(contexts[::-1]))
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][2][0] != outcomes[0][2][1]  # the rows differ, so a stale replay would show


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
@pytest.mark.parametrize("plugin", ["gdn", "gla", "mamba2", "qwen"])
def test_every_step_runs_in_the_graph_from_the_first(plugin, device, monkeypatch):
    """The first step after a prefill starts from a pending commit of nothing
    (``ModelAdapter.empty_commit``), so no step runs outside the recorded (here: fixed-shape)
    step, in the first ``generate`` (the graph is recorded at its first step) and the next (it
    is replayed), and both give eager decoding's tokens and acceptance, with the plugins'
    kernels (interpreted on the CPU) and drafts that get accepted."""
    from specla.cuda.graph_step import GraphRunner
    from specla.registry import get_plugin

    arch = get_plugin(plugin)
    model = arch.tiny_model(arch.tiny_variants[0], seed=1)
    V = model.get_input_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(4)
    motif = torch.randint(0, V, (4,), generator=g).tolist()
    batches = [[motif * 4, torch.randint(0, V, (7,), generator=g).tolist()],
               [torch.randint(0, V, (11,), generator=g).tolist(), motif * 3 + [motif[0]]]]
    cfg = dict(num_draft_tokens=6, max_depth=4, top_k=2, max_new_tokens=24, device=device, dtype="float32")
    fixed = dict(budget_policy="fixed")
    eager = SpecDecoder(model, plugin, drafter="ngram", config=dict(cfg, engine=dict(fixed, cuda_graphs="off")))
    graphed = SpecDecoder(model, plugin, drafter="ngram", config=dict(
        cfg, engine=dict(fixed, cuda_graphs="on" if device == "cuda" else "unrecorded")))
    calls = {"body": 0, "record": 0}
    body, record = GraphRunner._body, GraphRunner._record

    def counted_body(self, *a):
        calls["body"] += 1
        return body(self, *a)

    def counted_record(self, *a):
        calls["record"] += 1
        return record(self, *a)

    monkeypatch.setattr(GraphRunner, "_body", counted_body)
    monkeypatch.setattr(GraphRunner, "_record", counted_record)
    eager_steps, accepted = [], 0
    for prompts in batches:
        calls.update(body=0, record=0)
        want, got = eager.generate(prompts), graphed.generate(prompts)
        eager_steps.append(calls["body"] - calls["record"])
        assert got.outputs == want.outputs
        assert got.stats.accepted_histogram == want.stats.accepted_histogram
        accepted += sum(k * n for k, n in enumerate(want.stats.accepted_histogram))
    assert eager_steps == [0, 0]
    assert accepted > 0  # drafts were accepted


def test_sliced_records_take_their_layout_in_the_static_buffers():
    """On the kernel path GDN records each layer's conv inputs as a column slice of its one fused
    input projection: the runner's static buffers take that layout at the warm-up (the empty
    record was dense) and copy it as whole rows (``copy_into``), and the recorded steps still
    give eager decoding's tokens; the conv windows are committed in place (no copy back)."""
    from specla.cuda.capture import whole_rows

    device = "cuda" if torch.cuda.is_available() else "cpu"  # kernels interpreted on the CPU, compiled on a GPU
    prompts = [[11, 2040, 7, 391, 11, 2040, 7]]
    cfg = dict(device=device, dtype="float32", max_new_tokens=6, num_draft_tokens=3, max_depth=3, top_k=1)
    triton = dict(kernels="triton")
    eagle = str(ASSETS / "tiny-eagle")
    want = SpecDecoder(ASSETS / "tiny", drafter=eagle,
                       config=dict(cfg, engine=dict(triton, cuda_graphs="off"))).generate(prompts)
    graphed = SpecDecoder(ASSETS / "tiny", drafter=eagle, config=dict(
        cfg, engine=dict(triton, cuda_graphs="on" if device == "cuda" else "unrecorded")))
    got = graphed.generate(prompts)
    assert got.outputs == want.outputs
    assert sum(k * n for k, n in enumerate(want.stats.accepted_histogram)) > 0
    ad, g = graphed.engine.adapter, graphed.engine._runner.graphs[1]
    sliced = [t for t in g.state if whole_rows(t) is not None]
    assert len(sliced) == sum(m.conv is not None for m in ad.mixers)  # one conv-input record per conv layer
    assert all(any(m.conv is t for t in g.state) for m in ad.mixers if m.conv is not None)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
@pytest.mark.parametrize("plugin", ["gdn", "gla", "mamba2", "qwen"])
def test_fixed_shape_prefill_equals_eager_prefill(plugin, device):
    """The prefill of ``cuda_graphs="unrecorded"`` (CPU) or ``"on"`` (CUDA: recorded once, then
    replayed) runs 64-token chain passes on static buffers: recurrent states, conv windows and
    last-layer features equal the eager prefill's (float32, to rounding), with ragged prompts
    over two chunks and a one-token prompt, twice (the second from the recorded graph), then
    longer prompts (an attention cache grows: the graph is recorded again); over
    ``PREFILL_GRAPH_MAX_BATCH`` prompts the prefill stays eager."""
    from specla.model.prefill import PREFILL_GRAPH_MAX_BATCH
    from specla.registry import get_plugin

    arch = get_plugin(plugin)
    model = arch.tiny_model(arch.tiny_variants[0], seed=1)
    V = model.get_input_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (70, 1, 131, 9)]
    static = "on" if device == "cuda" else "unrecorded"
    adapters = {m: arch.make_adapter(model, SpecConfig(device=device, dtype="float32",
                                                       engine=dict(cuda_graphs=m, kernels="auto")))
                for m in ("off", static)}
    for batch in (prompts, prompts[::-1], [p * 4 for p in prompts]):
        for ad in adapters.values():
            ad.prefill(batch)
        want, got = adapters["off"], adapters[static]
        assert [t.shape for t in got._state_list()] == [t.shape for t in want._state_list()]
        for a, b in zip(got._state_list() + [got.last_hidden], want._state_list() + [want.last_hidden]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        for b, p in enumerate(batch):  # the features of each prompt's own tokens (padding differs)
            torch.testing.assert_close(got.prompt_hidden[b, : len(p) - 1], want.prompt_hidden[b, : len(p) - 1],
                                       rtol=1e-4, atol=1e-5)
    assert got._prefill_mode(len(prompts)) == ("record" if device == "cuda" else "unrecorded")
    assert got._prefill_mode(PREFILL_GRAPH_MAX_BATCH + 1) is None
    if device == "cuda":
        assert got._prefill_graphs[len(prompts)].graph is not None


@pytest.mark.parametrize("plugin", ["gdn", "gla", "mamba2", "qwen", "mamba2_hybrid", "kimi_linear"])
def test_empty_commit_lays_out_the_kernel_records(plugin):
    """The conformance suite's empty-commit check on the plugins' Triton path (float32,
    ``kernels="triton"``: interpreted on the CPU, compiled on a GPU): the zeroed records a graph
    is recorded from have the shapes and dtypes of the records the kernels leave."""
    import random

    from specla.registry import get_plugin
    from specla.testing import PluginSuite

    device = "cuda" if torch.cuda.is_available() else "cpu"
    PluginSuite.check_empty_commit(get_plugin(plugin), random.Random(3), engine={"kernels": "triton"},
                                   dtype="float32",
                                   device=device)


@cuda
def test_a_capture_survives_an_older_graph_awaiting_collection():
    """An older CUDA graph left in a reference cycle (a dropped decoder) is not freed during a
    later capture: the automatic collection a capture's allocations would trigger stays off
    (freeing a graph while another records invalidates that capture), and is back on after."""
    from specla.cuda.capture import record_graph

    x = torch.randn(64, device="cuda")
    old = record_graph(lambda: x.mul_(2), "cuda")
    cycle = [old]
    cycle.append(cycle)
    del old, cycle
    thresholds = gc.get_threshold()

    def step():
        y.mul_(3).add_(1)
        if torch.cuda.is_current_stream_capturing():  # automatic collections while recording
            gc.set_threshold(1)
            [[] for _ in range(100)]

    try:
        y = torch.randn(64, device="cuda")
        want = y * 3 + 1
        g = record_graph(step, "cuda")
        y.copy_(want.sub(1).div(3))
        g.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(y, want)
        assert gc.isenabled()
    finally:
        gc.set_threshold(*thresholds)


NONFINITE_PROMPTS = [[5, 6, 7, 5, 6, 7, 5], [9, 8, 9, 8, 3], [100, 200, 300]]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
@pytest.mark.parametrize("temperature", [0, 0.7])
def test_a_graph_step_reports_nonfinite_logits_at_its_one_read(device, temperature):
    """The fixed-shape step (recorded on a GPU, unrecorded on the CPU) computes which rows' logits
    are not finite and the host raises at the step's outcome read: a NaN in the LM head's row of
    token 7, written in place after the graphs were recorded, makes every row's logits NaN; the 3
    prompts run in a graph of 4 rows whose dead row is not named. With the weight restored the
    decoder decodes as before."""
    cfg = dict(device=device, dtype="float32", max_new_tokens=8, temperature=temperature, seed=1,
               engine=dict(cuda_graphs="on" if device == "cuda" else "unrecorded", budget_policy="fixed"))
    dec = SpecDecoder(ASSETS / "tiny", drafter="ngram", config=cfg)
    clean = dec.generate(NONFINITE_PROMPTS).outputs
    head = dec.adapter.model.lm_head.weight  # the weight the adapter's LM head reads
    saved = head[7].clone()
    with torch.no_grad():
        head[7] = float("nan")
    with pytest.raises(NonFiniteLogitsError, match=r"^prompts 0, 1, 2: the model's logits at decode step 1 hold NaN"):
        dec.generate(NONFINITE_PROMPTS)
    with torch.no_grad():
        head[7] = saved
    assert dec.generate(NONFINITE_PROMPTS).outputs == clean


@pytest.mark.parametrize("row, named", [(3, None), (1, "prompt 1")])
def test_only_live_graph_rows_are_named_for_nonfinite_logits(monkeypatch, row, named):
    """3 prompts fill 4 graph rows: NaN logits in the dead row 3 (unrecorded step, on the CPU)
    change nothing; in row 1 they raise naming prompt 1 and the step."""
    cfg = dict(dtype="float32", max_new_tokens=8, engine=dict(cuda_graphs="unrecorded", budget_policy="fixed"))
    dec = SpecDecoder(ASSETS / "tiny", drafter="ngram", config=cfg)
    clean = dec.generate(NONFINITE_PROMPTS).outputs
    poison_logits(monkeypatch, dec.adapter, 2, [row], float("nan"), EVERY_TOKEN)
    if named is None:
        assert dec.generate(NONFINITE_PROMPTS).outputs == clean
        return
    with pytest.raises(NonFiniteLogitsError, match=rf"^{named}: the model's logits at decode step 2 hold NaN"):
        dec.generate(NONFINITE_PROMPTS)
