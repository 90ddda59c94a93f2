"""The serving engines' own GDN and KDA Triton kernels, at pinned versions, imported by file: the
oracles of ``tests/mixers/test_gdn_engine_oracles.py`` and ``test_kda_engine_oracles.py`` and the
contenders of ``benchmarks/engine_kernels.py``.

The kernel files come from the package registry into a per-user cache (``$SPECLA_ENGINE_CACHE``,
default ``~/.cache/specla/engine-kernels``): ``pip download --no-deps`` of one wheel each
(SGLang's is 39 MB, vLLM's 239 MB: neither publishes an sdist pip can fetch without building it),
of which only the kernel files are kept, at ``<cache>/<name>-<version>/<path in the wheel>``. A
folder of that layout elsewhere (``root``; :func:`extract` writes one) is read instead, with no
download: a machine without network. The two package-level helpers SGLang's kernel file imports
(hardware probes, answered from torch) and vLLM's Triton re-exports (``vllm.triton_utils``, and
for KDA ``exp``/``log`` of FLA's ``ops/op.py``, which are ``tl.exp``/``tl.log`` unless
``FLA_USE_FAST_OPS`` is set) and platform probe are stubbed, nothing else.

- SGLang 0.5.23: ``recurrent`` holds ``fused_sigmoid_gating_delta_rule_update`` (GDN, and KDA with
  ``is_kda=True``: decode, tree verify with ``retrieve_parent_token`` +
  ``intermediate_states_buffer``, ReplaySSM ring writes); ``fold`` holds
  ``commit_gdn_replayssm_fold_all_layers`` (GDN ReplaySSM's commit), ``kda_fold``
  ``commit_kda_replayssm_spec`` / ``_all_layers`` (KDA's).
- vLLM 0.34.0: ``fused_sigmoid_gating_delta_rule_update`` (GDN chains, one state slot per draft
  position through ``ssm_state_indices [N, T]`` and ``num_accepted_tokens``); ``kda_chain``:
  ``fused_recurrent_kda`` (KDA chains likewise: Kimi Linear's spec path in
  ``layers/mamba/gdn/kimi_gdn_linear_attn.py``), with ``math_utils`` it imports.
"""

from __future__ import annotations

import importlib.util
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
})
VLLM = dict(name="vllm", version="0.34.0", platform="manylinux_2_28_x86_64", files={
    "chain": "vllm/third_party/flash_linear_attention/ops/fused_sigmoid_gating.py",
    "kda_chain": "vllm/models/kimi_k3/nvidia/ops/third_party/kda/fused_recurrent.py",
    "math_utils": "vllm/utils/math_utils.py",
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
    downloaded once per version.

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


def interpreter_bool_masks(monkeypatch) -> None:
    """Masks read as bool by Triton's interpreter's masked loads and stores, through ``monkeypatch``
    (a pytest ``MonkeyPatch``). The engines' Mamba2 kernels narrow a block mask by a scalar
    comparison (``mask &= slot != pad_slot_id``), which the interpreter computes as int32 data
    under an int1 type and its masked loads then refuse ("mask has unsupported dtype"); compiled
    Triton takes it."""
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    for name in ("create_masked_load", "create_masked_store"):
        op = getattr(InterpreterBuilder, name)

        def as_bool(self, ptrs, value_or_mask, *rest, op=op, store=name.endswith("store")):
            mask = rest[0] if store else value_or_mask
            mask = TensorHandle(mask.data.astype(bool), mask.dtype)
            return op(self, ptrs, value_or_mask, mask, *rest[1:]) if store else op(self, ptrs, mask, *rest)

        monkeypatch.setattr(InterpreterBuilder, name, as_bool)


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
    """SGLang 0.5.23's GDN and KDA kernel modules: ``recurrent``, ``fold`` and ``kda_fold``.
    Raises as :func:`kernel_files`."""
    files = kernel_files(SGLANG, root)
    jit, utils = _sglang_probes()
    folds = {key: _import_by_file(f"_engine_sglang_{key}", files[key], {}) for key in ("fold", "kda_fold")}
    if _interpreted():
        for fold in folds.values():  # their loop variables are Triton scalars (`t.to(tl.int64)`), not ints
            fold.range = _triton_range
    recurrent = _import_by_file("_engine_sglang_recurrent", files["recurrent"],
                                {"sglang.kernels.jit.utils": jit, "sglang.srt.utils": utils})
    return types.SimpleNamespace(recurrent=recurrent, **folds)


def load_vllm(root: Path | str | None = None) -> types.ModuleType:
    """vLLM 0.34.0's GDN gated-recurrence kernel module. Raises as :func:`kernel_files`."""
    import triton.language as tl

    files = kernel_files(VLLM, root)
    return _import_by_file("_engine_vllm_chain", files["chain"], {"vllm.triton_utils": dict(tl=tl, triton=triton)})


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
