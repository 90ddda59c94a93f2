"""Operators and Triton launches of a recorded step, part by part, counted on the CPU: a proxy for
the kernels the step launches on a GPU, which bounds its time at small batch (BENCHMARKS.md
section 4, step anatomy).

    TRITON_INTERPRET=1 python benchmarks/scripts/count_ops.py [--preset small] > ops.jsonl

A randomly initialised model of a ``train_target.py`` preset's shape (FLA's GDN model; for
``small-hybrid``, transformers' Qwen3.5 hybrid) with a random attention EAGLE head, float32, one
69-token prompt, batch 1; rows AR (N 0) and the EAGLE tree (N 15, depth 6, top-k 4); for
``small-hybrid`` also the EAGLE chain and the chain of a random MTP layer of the model's own
classes (N 6, ``drafter="mtp"``'s drafter). After one step, each part of the next step is counted: the drafter's tree
(``propose_on_device``), ``verify`` (the pending commit fused), greedy acceptance, the commit
bookkeeping and the drafter's update; then the whole recorded step body (``GraphRunner._record``)
once more. Counted: every PyTorch operator that reaches a backend (``TorchDispatchMode``; views
and allocations left out) and, with ``TRITON_INTERPRET=1``, every Triton launch by kernel name
(the interpreter's own tensor traffic left out); without it, the PyTorch path
(``kernels="reference"``) alone. One JSON line per row and part. Some PyTorch operators launch
several kernels on a GPU (``torch.topk`` over a vocabulary-wide row about twenty, a cuBLAS
split-K product two), so the GPU's counts are higher; the torch profiler's are in
``step_anatomy.py``. CPU only; FLA installed (it defines the GDN model class).

    TRITON_INTERPRET=1 python benchmarks/scripts/count_ops.py --preset small-hybrid > ops.jsonl
"""
import argparse
import collections
import inspect
import json
import os
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "targets"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM  # noqa: E402
from provenance import add_allow_dirty, print_meta  # noqa: E402
from train_target import PRESETS  # noqa: E402

import specla.cuda.graph_step as G  # noqa: E402
from specla import SpecDecoder  # noqa: E402
from specla.acceptance import accept_greedy  # noqa: E402
from specla.drafters.eagle import EagleDrafter, EagleHead  # noqa: E402

NOT_KERNELS = {"view", "_unsafe_view", "expand", "slice", "select", "unsqueeze", "squeeze", "permute", "t",
               "transpose", "as_strided", "reshape", "alias", "detach", "split", "chunk", "unbind", "narrow",
               "flatten", "lift_fresh", "_reshape_alias", "split_with_sizes", "empty", "empty_like",
               "empty_strided", "new_empty", "new_empty_strided", "set_", "promote_types", "scalar_tensor"}
ROWS = {"ar": dict(num_draft_tokens=0), "eagle-tree": dict(num_draft_tokens=15, max_depth=6, top_k=4)}
CHAIN = dict(num_draft_tokens=6, max_depth=6, top_k=1)
HYBRID_ROWS = {**ROWS, "eagle-chain": CHAIN, "mtp-chain": CHAIN}


class Count(TorchDispatchMode):
    """Counts the operators dispatched inside it, by name."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in NOT_KERNELS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


LAUNCHES: collections.Counter = collections.Counter()


def count_launches() -> None:
    """Counts every interpreted Triton launch by kernel name into :data:`LAUNCHES`, outside the
    dispatch counting (the interpreter's own tensor traffic is not the kernel's)."""
    from torch.utils._python_dispatch import _pop_mode_temporarily
    from triton.runtime import interpreter

    run = interpreter.InterpretedFunction.run

    def counted(self, *args, **kwargs):
        LAUNCHES[self.fn.__name__] += 1
        if torch._C._len_torch_dispatch_stack():
            with _pop_mode_temporarily():
                return run(self, *args, **kwargs)
        return run(self, *args, **kwargs)

    interpreter.InterpretedFunction.run = counted


def counted(fn):
    """``fn()`` under the counters: ``(result, operators by name, launches by name)``."""
    LAUNCHES.clear()
    with Count() as c:
        out = fn()
    return out, dict(c.ops.most_common()), dict(LAUNCHES.most_common())


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small", choices=("tiny", "small", "small-hybrid"),
                   help="the model shape: a preset of train_target.py")
    a = add_allow_dirty(p).parse_args()
    print_meta("cpu", a.allow_dirty)  # counted on the CPU
    kernels = "triton" if os.environ.get("TRITON_INTERPRET") == "1" else "reference"
    if kernels == "triton":
        count_launches()
    walk = "kernels" in inspect.signature(accept_greedy).parameters  # the one-launch walk, where it exists
    torch.manual_seed(0)
    shape = PRESETS[a.preset]["model"]
    if PRESETS[a.preset].get("arch") == "qwen3_5":
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        from specla_qwen.mtp import MTPDrafter, QwenMTPHead

        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(vocab_size=32000, **shape)).float().eval()
        plugin, rows, mtp_head = "qwen", HYBRID_ROWS, QwenMTPHead(model, None)
    else:
        model = GatedDeltaNetForCausalLM(GatedDeltaNetConfig(vocab_size=32000, **shape)).float().eval()
        plugin, rows = "gdn", ROWS
    head = EagleHead(model.config.hidden_size)
    prompt = [torch.randint(0, 32000, (69,)).tolist()]
    for row, budget in rows.items():
        drafter = (MTPDrafter(mtp_head) if row.startswith("mtp") else EagleDrafter(head)) \
            if budget["num_draft_tokens"] else "ngram"
        dec = SpecDecoder(model, plugin, drafter=drafter,
                          config=dict(dtype="float32", device="cpu", max_new_tokens=16, stop_at_eos=False,
                                      engine=dict(cuda_graphs="unrecorded", budget_policy="fixed", kernels=kernels),
                                      **budget))
        ad, dr, cfg = dec.adapter, dec.drafter, dec.config
        ad.prefill(prompt)
        dr.reset(prompt)
        runner = G.GraphRunner(ad, dr, cfg, capture=False)
        runner.step(prompt)  # leaves the state a recorded step starts from, bound to its buffers
        graph = runner._bound
        depth = min(cfg.max_depth, cfg.num_draft_tokens)
        parts = {}
        ad.static_shapes = True
        try:
            if budget["num_draft_tokens"]:
                tree, *parts["propose"] = counted(lambda: dr.propose_on_device(ad.roots, cfg))
            else:
                from specla.tree import DraftTree
                tree = DraftTree.empty(ad.batch_size, ad.device)
            out, *parts["verify"] = counted(lambda: ad._verify(tree))
            kw = dict(kernels=kernels == "triton") if walk else {}
            acc, *parts["accept"] = counted(lambda: accept_greedy(tree, out.logits, max_depth=depth, **kw))
            _, *parts["commit"] = counted(lambda: ad._commit(tree, out, acc))
            _, *parts["drafter_update"] = counted(lambda: dr.on_commit(acc, out))
        finally:
            ad.static_shapes = False
        runner.release()
        runner.step(prompt)  # rebinds the state to the buffers
        _, *parts["step"] = counted(lambda: runner._record(graph))
        for part, (ops, launches) in parts.items():
            print(json.dumps(dict(row=row, part=part, kernels=kernels, preset=a.preset, operators=sum(ops.values()),
                                  triton_launches=sum(launches.values()), ops=ops, launches=launches)), flush=True)


if __name__ == "__main__":
    main()
