"""Operators dispatched by the parts of a speculative step, counted on the CPU: a proxy for the
kernels a recorded step launches on a GPU, which bounds its time at small batch (BENCHMARKS.md
section 4, step anatomy).

    TRITON_INTERPRET=1 python benchmarks/scripts/count_ops.py > ops.json

A randomly initialised GDN model of the ``small`` preset's shape with a random attention EAGLE
head, float32, one 69-token prompt; tree N 15, depth 6, top-k 4. Counted: every PyTorch operator
that reaches a backend (``TorchDispatchMode``; views and allocations left out) in the EAGLE
drafter's tree (``propose_on_device``) with the PyTorch draft levels (``kernels="reference"``)
and, with ``TRITON_INTERPRET=1``, with the Triton forms (``kernels="triton"``; their launches
counted apart, the interpreter's own tensor traffic left out), and in greedy acceptance of that
tree (with ``kernels="triton"`` its one-launch walk). One JSON object per part. CPU only; FLA
installed (it defines the model class).
"""
import collections
import json
import os
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "targets"))
from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM  # noqa: E402
from train_target import PRESETS  # noqa: E402

import specla.graphs as G  # noqa: E402
from specla import SpecDecoder  # noqa: E402
from specla.acceptance import accept_greedy  # noqa: E402
from specla.drafters.eagle import EagleDrafter, EagleHead  # noqa: E402

NOT_KERNELS = {"view", "_unsafe_view", "expand", "slice", "select", "unsqueeze", "squeeze", "permute", "t",
               "transpose", "as_strided", "reshape", "alias", "detach", "split", "chunk", "unbind", "narrow",
               "flatten", "lift_fresh", "_reshape_alias", "split_with_sizes", "empty", "empty_like",
               "empty_strided", "new_empty", "new_empty_strided", "set_", "promote_types", "scalar_tensor"}


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


def triton_launches():
    """Counts the launches of the Triton forms a draft level uses (the top-k takes two)."""
    from specla.ops import accept_triton, act_triton, attention_triton, norm_triton, topk_triton

    calls = collections.Counter()
    for mod, name, launches in ((norm_triton, "rms_norm", 1), (act_triton, "swiglu", 1),
                                (attention_triton, "draft_attention", 1), (topk_triton, "log_softmax_topk", 2),
                                (accept_triton, "greedy_walk", 1)):
        fn = getattr(mod, name)

        def counted(*a, _fn=fn, _name=name, _n=launches, **k):
            calls[_name] += _n
            with _PAUSE():  # the interpreter's own tensor traffic is not the kernel's
                return _fn(*a, **k)

        setattr(mod, name, counted)
    return calls


class _PAUSE:
    """Leaves the innermost dispatch mode while the Triton interpreter runs a kernel."""

    def __enter__(self):
        from contextlib import nullcontext

        from torch.utils._python_dispatch import _pop_mode_temporarily

        self._ctx = _pop_mode_temporarily() if torch._C._len_torch_dispatch_stack() else nullcontext()
        self._ctx.__enter__()

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)


def main():
    torch.manual_seed(0)
    model = GatedDeltaNetForCausalLM(GatedDeltaNetConfig(vocab_size=32000, **PRESETS["small"]["model"])).float().eval()
    head = EagleHead(model.config.hidden_size)
    prompt = [torch.randint(0, 32000, (69,)).tolist()]
    kinds = ["reference"] + (["triton"] if os.environ.get("TRITON_INTERPRET") == "1" else [])
    calls = triton_launches() if "triton" in kinds else collections.Counter()
    dec = SpecDecoder(model, "gdn", drafter=EagleDrafter(head), config=dict(
        dtype="float32", device="cpu", cuda_graphs="unrecorded", max_new_tokens=16, stop_at_eos=False,
        num_draft_tokens=15, max_depth=6, top_k=4, budget_policy="fixed", kernels="reference"))
    ad, dr, cfg = dec.adapter, dec.drafter, dec.config
    ad.prefill(prompt)
    dr.reset(prompt)
    G.GraphRunner(ad, dr, cfg, capture=False).step(prompt)  # leaves the state a recorded step starts from
    for kernels in kinds:
        # the target's verify stays on the PyTorch path (the interpreter would take minutes); the
        # drafter and the LM head's norm take the forms a GPU runs
        dr.kernels = kernels == "triton"
        type(ad).triton_kernels = property(lambda self, k=kernels: k == "triton")
        ad.static_shapes = True
        calls.clear()
        with Count() as c:
            tree = dr.propose_on_device(ad.roots, cfg)
        print(json.dumps(dict(part="propose", kernels=kernels, operators=sum(c.ops.values()),
                              triton_launches=sum(calls.values()), by_name=dict(c.ops.most_common()))), flush=True)
        logits = torch.randn(1, 16, 32000)
        calls.clear()
        with Count() as c:
            accept_greedy(tree, logits, max_depth=6, kernels=kernels == "triton")
        print(json.dumps(dict(part="accept_greedy", kernels=kernels, operators=sum(c.ops.values()),
                              triton_launches=sum(calls.values()), by_name=dict(c.ops.most_common()))), flush=True)
        ad.static_shapes = False


if __name__ == "__main__":
    main()
