"""The oracle of the plugins for transformers' classes: the model itself, greedy, without a cache.

Every step runs the model's forward over the whole sequence so far, with no cache, on
transformers' PyTorch path, and takes the argmax of the last logits. transformers routes some
sequence mixers to external kernels when they are installed (the gated delta rule to FLA's Triton
kernel, which cannot run on a CPU; Mamba2's scan and causal conv to ``mamba_ssm`` and
``causal_conv1d``); :func:`torch_path` swaps in transformers' own PyTorch functions for the
duration.
"""

from __future__ import annotations

import contextlib
import sys
import threading

import torch

_PATCH_LOCK = threading.Lock()
_PATCHED = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule",
            "causal_conv1d_fn", "causal_conv1d_update", "mamba2_chunk_scan",
            "mamba2_selective_state_update", "mamba2_split_conv1d_scan_combined", "chunk_kimi_delta_attention",
            "recurrent_kimi_delta_attention")


@contextlib.contextmanager
def torch_path(model: torch.nn.Module):
    """Run ``model``'s sequence-mixer functions (:data:`_PATCHED`: gated delta rule, chunked and
    recurrent (a cached ``generate``'s decode steps), causal conv, Mamba2 scan, KDA) on
    transformers' PyTorch versions (the undecorated ``__wrapped__`` of its
    hub-kernel fallback) while the block runs; one caller at a time (the swap is process-wide)."""
    module = sys.modules[type(model).__module__]
    with _PATCH_LOCK:
        saved = {n: getattr(module, n) for n in _PATCHED if hasattr(module, n)}
        try:
            for n, fn in saved.items():
                setattr(module, n, getattr(fn, "__wrapped__", fn))
            yield
        finally:
            for n, fn in saved.items():
                setattr(module, n, fn)


@torch.no_grad()
def transformers_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """``max_new_tokens`` greedy tokens after ``prompt`` from full no-cache forwards of
    ``model`` (a transformers causal LM) on its device."""
    dev = model.get_input_embeddings().weight.device
    ids = list(prompt)
    with torch_path(model):
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([ids], device=dev), use_cache=False).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt):]


@torch.no_grad()
def spread_parameters(model: torch.nn.Module) -> torch.nn.Module:
    """Spread a freshly initialised transformers model's parameters (tiny test models), in place:
    decays (``A_log``) over ``[-2, 1]``, ``dt_bias`` normal, Mamba2 skips (``.D``) around 1, norm
    weights and biases away from 1 and 0, so that paths differ and no weight hides a bug by being
    0 or 1. Returns ``model``."""
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.uniform_(-2.0, 1.0)
        elif name.endswith("dt_bias"):
            p.normal_(0.0, 1.0)
        elif name.endswith(".D"):
            p.normal_(1.0, 0.5)
        elif "norm" in name:
            p.add_(torch.randn_like(p) * 0.2)
        elif name.endswith("bias"):
            p.normal_(0.0, 0.3)
    return model
