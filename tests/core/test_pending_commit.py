"""The pending commit (:class:`specla.records.PendingCommit`): built once per step, its per-layer
pieces handed as they are to each mixer and verify kernel, and its tensors listed and bound back
in one fixed order (what the CUDA-graph state is made of)."""

import importlib
import importlib.util
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor

import specla.mixers.gdn.mixer as gdn_mixer
from specla import DraftTree, SpecConfig
from specla.acceptance import accept_greedy
from specla.records import LayerCommit, PendingCommit, Record
from specla.registry import get_plugin


@dataclass(frozen=True)
class PairRecord(Record):
    a: Tensor  # [B, T]
    pair: tuple[Tensor, Tensor]  # [B, T] each
    none: Tensor | None = None


def records(B: int = 3, T: int = 4) -> list[PairRecord]:
    g = torch.Generator().manual_seed(0)
    r = lambda: torch.randn(B, T, generator=g)  # noqa: E731
    return [PairRecord(r(), (r(), r())), PairRecord(r(), (r(), r()))]


def test_layers_share_the_paths_and_tensors_round_trip_through_rebind():
    recs = records()
    path, plen = torch.tensor([[0, 1], [0, -1], [0, 2]]), torch.tensor([2, 1, 0])
    p = PendingCommit.from_records(recs, path, plen)
    assert [layer.record for layer in p.layers] == recs and p.records == tuple(recs)
    assert all(layer.path is path and layer.path_len is plen for layer in p.layers)
    listed = p.tensors()
    assert len(listed) == 8 and all(x is y for x, y in zip(listed, [*recs[0].tensors(), *recs[1].tensors(), path, plen]))

    fresh = [t.clone() for t in listed]
    end = torch.zeros(1)
    it = iter([*fresh, end])
    q = p.rebind(it)
    assert next(it) is end  # the iterator is left at the first tensor not taken
    assert all(x is y for x, y in zip(q.tensors(), fresh)) and len(q.tensors()) == len(fresh)
    assert all(layer.path is q.path and layer.path_len is q.path_len for layer in q.layers)
    assert q.layers[1].record.pair[1] is fresh[5] and q.layers[0].record.none is None


def test_select_keeps_rows_of_every_layer_and_the_paths():
    recs = records()
    path, plen = torch.tensor([[0, 1], [0, -1], [0, 2]]), torch.tensor([2, 1, 0])
    index = torch.tensor([2, 0])
    q = PendingCommit.from_records(recs, path, plen).select(index)
    assert torch.equal(q.path, path[index]) and torch.equal(q.path_len, plen[index])
    assert all(layer.path is q.path and layer.path_len is q.path_len for layer in q.layers)
    for got, want in zip(q.records, recs):
        assert all(torch.equal(x, y[index]) for x, y in zip(got.tensors(), want.tensors()))


@pytest.mark.parametrize("kernels", ["reference", "triton"])
def test_each_mixer_and_verify_kernel_takes_the_layer_commit_it_is_handed(kernels, monkeypatch):
    """The next verify hands ``pending.layers[i]`` itself to mixer ``i``, and a GDN mixer hands it
    on to its verify kernel (``kernels="triton"``: compiled on a GPU, under Triton's interpreter
    on the CPU). Eager steps: a recorded step would replay its launches without these calls."""
    arch = get_plugin("gdn")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    adapter = arch.make_adapter(arch.tiny_model(arch.tiny_variants[0], dtype=torch.float32).to(device),
                                SpecConfig(dtype="float32", device=device,
                                           engine={"kernels": kernels, "cuda_graphs": "off"}))
    adapter.prefill([[3, 1, 4, 1, 5], [9, 2, 6]])
    tree = DraftTree.from_lists([([2, 7, 1], [-1, 0, 1]), ([8, 2], [-1, -1])], device=device)
    out = adapter.verify(tree)
    adapter.commit(tree, out, accept_greedy(tree, out.logits))
    pending = adapter.pending
    assert isinstance(pending, PendingCommit) and len(pending.layers) == len(adapter.mixers)
    assert all(isinstance(layer, LayerCommit) and layer.path is pending.path for layer in pending.layers)

    handed, launched = [], []
    for m in adapter.mixers:
        verify = m.verify
        monkeypatch.setattr(m, "verify", lambda h, tp, p, verify=verify: handed.append(p) or verify(h, tp, p))
    run = gdn_mixer.run_verify_kernel
    monkeypatch.setattr(gdn_mixer, "run_verify_kernel", lambda *a: launched.append(a[-1]) or run(*a))
    adapter.verify(tree)
    assert len(handed) == len(pending.layers) and all(p is layer for p, layer in zip(handed, pending.layers))
    gdn_layers = [layer for m, layer in zip(adapter.mixers, pending.layers) if isinstance(m, gdn_mixer.GDNMixer)]
    assert gdn_layers
    assert (launched == []) if kernels == "reference" else all(p is q for p, q in zip(launched, gdn_layers, strict=True))


@pytest.mark.parametrize("plugin", ["gdn", "gla", "kimi_linear", "mamba2"])
def test_flush_commit_takes_the_layer_commit_it_is_handed(plugin, monkeypatch):
    """A flush on the kernel path hands ``pending.layers[i]`` itself to the commit kernel of
    mixer ``i``'s op (``specla.mixers.<op>.commit.flush_commit``: compiled on a GPU, under
    Triton's interpreter on the CPU), once per layer of an op that has one, in mixer order."""
    arch = get_plugin(plugin)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    adapter = arch.make_adapter(arch.tiny_model(arch.tiny_variants[0], dtype=torch.float32).to(device),
                                SpecConfig(dtype="float32", device=device,
                                           engine={"kernels": "triton", "cuda_graphs": "off"}))
    adapter.prefill([[3, 1, 4, 1, 5], [9, 2, 6]])
    tree = DraftTree.from_lists([([2, 7, 1], [-1, 0, 1]), ([8, 2], [-1, -1])], device=device)
    out = adapter.verify(tree)
    adapter.commit(tree, out, accept_greedy(tree, out.logits))
    pending = adapter.pending
    # the op of a mixer is the specla.mixers package of its class or of the class it extends
    ops = [next(c.__module__ for c in type(m).__mro__ if c.__module__.startswith("specla.mixers.")) for m in adapter.mixers]
    commit_modules = [op.rsplit(".", 1)[0] + ".commit" for op in ops]
    flushing = {name for name in commit_modules if importlib.util.find_spec(name)}  # attention has none
    handed = []
    for name in flushing:
        module = importlib.import_module(name)
        flush = module.flush_commit
        monkeypatch.setattr(module, "flush_commit", lambda state, p, flush=flush: handed.append(p) or flush(state, p))
    adapter.flush()
    expected = [layer for name, layer in zip(commit_modules, pending.layers) if name in flushing]
    assert expected and len(handed) == len(expected) and all(p is q for p, q in zip(handed, expected))
