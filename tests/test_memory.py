"""What a dropped decoder frees: its adapter, engine, drafter, model copy, states and caches go by
reference counting alone, with Python's cyclic garbage collector off (a cycle would keep them,
a converted model copy included, until the collector happens to run)."""

import gc
import weakref

import torch

from specla.layerwise import weaken_hook_cycles
from specla.registry import get_plugin


def test_weakened_hooks_still_run_and_hold_their_module_weakly():
    """transformers' ``Mamba2Model`` renames ``embedding.*`` to ``embeddings.*`` in a
    ``load_state_dict`` pre-hook, its own bound method: after :func:`weaken_hook_cycles` the
    renaming still happens, and the model is freed by reference counting."""
    model = weaken_hook_cycles(get_plugin("mamba2_hybrid").tiny_model("mamba2"))
    state = {k.replace("embeddings.", "embedding."): torch.zeros_like(v) if "embeddings." in k else v
             for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    assert model.backbone.embeddings.weight.abs().sum().item() == 0.0
    ref = weakref.ref(model.backbone)
    gc.disable()
    try:
        del model
        assert ref() is None
    finally:
        gc.enable()
