"""Run FLA's own models (GatedDeltaNetForCausalLM, GLAForCausalLM, Mamba2ForCausalLM) as an
oracle: on the CPU under the Triton interpreter, or on a CUDA device compiled.

This is a test helper, not a test module: it gives tests an oracle implemented
independently of specla (FLA's Triton kernels, executed by ``TRITON_INTERPRET=1``
on a CPU; :func:`fla_device` says which of the two this process runs).

Caller contract: ``os.environ["TRITON_INTERPRET"] = "1"`` must be set before
``fla`` (or anything else defining ``@triton.jit`` kernels) is imported; simplest
is the very top of ``conftest.py``, before importing torch/triton/fla. The
decorator picks interpreter vs. GPU compilation when the kernel is defined, so
setting it later leaves FLA's kernels as GPU JITFunctions that cannot run here.
``enable_fla_interpreter()`` raises RuntimeError if the variable is missing or
if ``fla`` was already imported without it.

Usage::

    from fla_oracle import fla_device, fla_forward_logits
    device = fla_device()           # "cpu" (interpreter installed, idempotent) or "cuda"
    from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM
    model = GatedDeltaNetForCausalLM(GatedDeltaNetConfig(...)).float().eval().to(device)
    logits = fla_forward_logits(model, input_ids)   # [B, T, vocab] float32

Everything is done by monkeypatching Triton's Python runtime at run time; no
file in site-packages is modified. The patches only affect interpreter mode; on a CUDA
device nothing is patched.
"""
from __future__ import annotations

import ast
import copy
import os
import sys

import torch

__all__ = ["enable_fla_interpreter", "fla_device", "fla_forward_logits", "fla_greedy_generate"]

_ENABLED = False
# Name injected into the kernel module's globals for the rewritten loops.
_RANGE_HELPER = "__fla_oracle_tensor_range__"


def enable_fla_interpreter() -> None:
    """Install the Triton-interpreter workarounds FLA needs (idempotent).

    Raises:
        pytest.skip.Exception: ``TRITON_INTERPRET`` is not ``1`` (conftest.py compiles the kernels
            on a CUDA machine, where the oracle cannot run them on CPU tensors): the calling test
            is skipped.
        RuntimeError: ``fla`` was imported before ``TRITON_INTERPRET=1`` was set.
    """
    global _ENABLED
    if _ENABLED:
        return
    if os.environ.get("TRITON_INTERPRET") != "1":
        import pytest

        pytest.skip("needs FLA's kernels under Triton's CPU interpreter; TRITON_INTERPRET is not 1 here "
                    "(a CUDA machine compiles them)")
    import triton.language as tl
    from triton.runtime import autotuner, interpreter

    # knobs read the env lazily, but @triton.jit decided at FLA import time: if fla was
    # imported before TRITON_INTERPRET was set, its kernels are GPU JITFunctions.
    mod = sys.modules.get("fla.ops.gated_delta_rule.fused_recurrent")
    if mod is not None:
        k = mod.fused_recurrent_gated_delta_rule_fwd_kernel
        while not isinstance(k, interpreter.InterpretedFunction) and hasattr(k, "fn"):
            k = k.fn
        if not isinstance(k, interpreter.InterpretedFunction):
            raise RuntimeError("fla was imported before TRITON_INTERPRET=1 was set; set it earlier.")

    # 1) Autotuning: benchmarking needs a GPU driver ("0 active drivers"). Keep only
    #    the first config that survives the kernel's own early pruning, so
    #    Autotuner.run takes its no-benchmark path. Patched on the class, so it also
    #    covers autotuners created by an earlier `import fla` (and FLA's
    #    CachedAutotuner subclass).
    orig_prune = autotuner.Autotuner.prune_configs

    def prune_configs(self, kwargs):
        return orig_prune(self, kwargs)[:1]

    autotuner.Autotuner.prune_configs = prune_configs

    # 2) Loop indices: compiled Triton makes `range(...)`/`tl.range(...)` loop
    #    variables int32 tensors; the interpreter yields Python ints, so FLA code like
    #    `i_t.to(tl.int64)` (chunk_delta_h.py) fails. Rewrite such loops (not
    #    `tl.static_range`, whose index must stay a compile-time int) to yield
    #    interpreter scalar tensors, by extending the interpreter's AST rewriter.
    def tensor_range(it):
        for i in it:
            yield interpreter.interpreter_semantic.to_tensor(i)

    class _Transformer(interpreter.ASTTransformer):
        def visit_For(self, node):
            node = self.generic_visit(node)
            f = node.iter.func if isinstance(node.iter, ast.Call) else None
            if (isinstance(f, ast.Name) and f.id == "range") or (isinstance(f, ast.Attribute) and f.attr == "range"):
                node.iter = ast.Call(func=ast.Name(id=_RANGE_HELPER, ctx=ast.Load()), args=[node.iter], keywords=[])
            return node

    interpreter.FunctionRewriter.ast_transformer = _Transformer()
    orig_rewrite_ast = interpreter.FunctionRewriter.rewrite_ast

    def rewrite_ast(self):
        # the rewritten function is exec'd in the kernel module's globals
        self.fn.__globals__[_RANGE_HELPER] = tensor_range
        return orig_rewrite_ast(self)

    interpreter.FunctionRewriter.rewrite_ast = rewrite_ast
    interpreter.InterpretedFunction.rewritten_fn.clear()  # drop functions rewritten before the patch

    # 3) Speed only: the interpreter re-patches all of triton.language (inspect.getmembers
    #    over tl, tl.tensor, tl.math) on *every* @triton.jit helper call (exp, softplus,
    #    ... once per time step), which was >50% of the runtime. Inside a kernel launch
    #    the patches are already in place, so skip re-patching the same modules.
    orig_patch_lang = interpreter._patch_lang
    orig_grid_call = interpreter.GridExecutor.__call__
    state = {"patched": None}  # ids of tl/tl.core patched by the running launch

    def _patch_lang(fn):
        langs = {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}
        if state["patched"] is not None:
            if langs and langs <= state["patched"]:
                return interpreter._LangPatchScope()  # nothing new to patch / restore
            state["patched"] |= langs
        return orig_patch_lang(fn)

    def grid_call(self, *args, **kwargs):
        prev, state["patched"] = state["patched"], set()
        try:
            return orig_grid_call(self, *args, **kwargs)
        finally:
            state["patched"] = prev

    interpreter._patch_lang = _patch_lang
    interpreter.GridExecutor.__call__ = grid_call
    _ENABLED = True


def fla_device() -> str:
    """Where FLA's kernels run in this process, made ready: ``"cpu"`` under Triton's interpreter
    (``TRITON_INTERPRET=1``, :func:`enable_fla_interpreter` installed) or ``"cuda"`` compiled.

    Raises:
        pytest.skip.Exception: neither (the kernels are compiled but there is no CUDA device).
        RuntimeError: as :func:`enable_fla_interpreter`.
    """
    if os.environ.get("TRITON_INTERPRET") == "1":
        enable_fla_interpreter()
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    import pytest

    pytest.skip("FLA's kernels are compiled here (TRITON_INTERPRET is not 1) and there is no CUDA device")


def _fla_dtype(model):
    # FLA's kernels compute in fp32 and reject float64 models (fp32/fp64 operand and
    # fp_downcast_rounding errors), so a float64 model runs as a float32 copy.
    if any(p.dtype == torch.float64 for p in model.parameters()):
        return copy.deepcopy(model).float()
    return model


def fla_forward_logits(model, input_ids: torch.LongTensor, *, chunk: bool = False) -> torch.Tensor:
    """Full-sequence forward, no cache, on the model's device (``input_ids`` [B, T] or [T] go
    there). Returns logits [B, T, vocab] as float32.

    A float64 model is run as a float32 copy (FLA has no fp64 kernels), so compare
    with fp32-level tolerances (observed ~1e-6..5e-6 abs on tiny random models).

    FLA's GatedDeltaNet layer chooses its kernel from the grad mode: under no_grad
    (default here) with T <= 64 and eval() it uses `fused_recurrent`; with grad
    enabled it always uses `chunk`. `chunk=True` runs with grad enabled to get that
    second, independent kernel path (often faster in the interpreter for longer T).
    use_cache=False is passed, which makes FLA fuse the q/k/v short convs into one
    causal_conv1d call and keeps any cache object out of the picture.
    """
    fla_device()
    if model.training:
        raise ValueError("call model.eval() first (in training mode FLA's layer forces the chunk path)")
    model = _fla_dtype(model)
    input_ids = torch.as_tensor(input_ids, dtype=torch.long, device=next(model.parameters()).device)
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if chunk:
        with torch.enable_grad():
            logits = model(input_ids=input_ids, use_cache=False).logits.detach()
    else:
        with torch.no_grad():
            logits = model(input_ids=input_ids, use_cache=False).logits
    return logits.float()


def fla_greedy_generate(model, input_ids, max_new_tokens: int, *, chunk: bool = False) -> list[int]:
    """Greedy decoding for batch 1 by re-running the full forward every step (no cache).

    FLA's own cached ``generate`` is no oracle here: transformers 5.24 passes the cache as
    ``cache=``, which FLA's models ignore, so after the first token each step restarts from an
    empty state (docs/usage.md); one cached step called with ``past_key_values=`` does equal the
    forward on GDN and GLA.

    Returns only the newly generated token ids. Ties break to the lowest id (torch.argmax).
    """
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=next(model.parameters()).device).reshape(1, -1)
    model = _fla_dtype(model)  # convert once, not per step
    out: list[int] = []
    for _ in range(max_new_tokens):
        nxt = int(fla_forward_logits(model, ids, chunk=chunk)[0, -1].argmax())
        out.append(nxt)
        ids = torch.cat([ids, ids.new_tensor([[nxt]])], dim=1)
    return out


def whole_prompt_prefill_calls(monkeypatch) -> list:
    """Let ``prefill="chunked"`` run in this test and record FLA's chunked kernel calls
    (``chunk_gated_delta_rule`` for GDN layers, ``chunk_gla`` for GLA layers, ``chunk_simple_gla``
    for Mamba2 layers, ``chunk_kda`` for KDA layers): on a CPU,
    FLA's kernels are interpreted (:func:`enable_fla_interpreter`) and the mixers' whole-prompt
    paths, which the product takes on a GPU only, are allowed. Returns the list each call appends
    its query shape to."""
    import torch
    from fla.ops import gated_delta_rule, gla, kda, simple_gla
    from specla.mixers.gdn.mixer import GDNMixer
    from specla.mixers.gla.mixer import GLAMixer
    from specla.mixers.kda.mixer import KDAMixer
    from specla.mixers.mamba2.mixer import Mamba2Mixer

    if not torch.cuda.is_available():
        enable_fla_interpreter()
        for mixer in (GDNMixer, GLAMixer, Mamba2Mixer):
            monkeypatch.setattr(mixer, "prefills_whole", lambda self, kernels: kernels)
        monkeypatch.setattr(KDAMixer, "prefills_whole", lambda self, kernels: True)
    calls = []
    for module, name in ((gated_delta_rule, "chunk_gated_delta_rule"), (simple_gla, "chunk_simple_gla"),
                         (gla, "chunk_gla"), (kda, "chunk_kda")):
        fn = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, fn=fn, **kw: calls.append(a[0].shape) or fn(*a, **kw))
    return calls
