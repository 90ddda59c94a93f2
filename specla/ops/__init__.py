"""Architecture-agnostic operators the plugins share (FLA keeps the like in ``fla.modules``):
tree-aware short convolution (PyTorch, sequential twin, Triton kernels), normalisations, and softmax
attention under a draft tree over a fixed-capacity KV cache with its commit (``attention``), and
the kernels of a recorded step's bookkeeping (top-k, greedy acceptance, ancestor masks). Nothing
here names an architecture."""

import importlib
import importlib.util

import torch


class kernels:  # noqa: N801 (used like a module: ``conv_kernels = kernels("specla.ops.conv_triton")``)
    """A handle on a module of Triton kernels that imports it at the first attribute read.

    Triton is needed only where kernels run (a CUDA device, or the tests' interpreter), so the
    PyTorch paths import and run without it; and ``@triton.jit`` reads ``TRITON_INTERPRET`` when a
    kernel is defined, so kernels are defined where they are first used, not at import.

    Args:
        module: the absolute module name (``"specla.ops.conv_triton"``, ``"specla.mixers.gdn.verify"``).
    Raises:
        ImportError: at the first attribute read, when the module or Triton cannot be imported.
    """

    __slots__ = ("_name", "_module")

    def __init__(self, module: str):
        self._name, self._module = module, None

    def __getattr__(self, attr: str):
        if self._module is None:  # imported once; later reads go straight to the module's attribute
            self._module = importlib.import_module(self._name)
        return getattr(self._module, attr)

    def __repr__(self) -> str:
        return f"kernels({self._name!r})"


def fla_installed() -> bool:
    """Whether FLA (``flash-linear-attention``) is installed: the mixers' whole-prompt prefill runs
    its chunked kernels on a GPU where it is, and chains of specla's own kernels where it is not."""
    return importlib.util.find_spec("fla") is not None


def compiled_kernels_loaded() -> bool:
    """Whether a loaded module defines Triton kernels compiled, not interpreted: specla's own
    (``specla.ops.*_triton``, a plugin's kernel modules) or a library's (FLA's, which loading an FLA
    model imports). ``@triton.jit`` reads ``TRITON_INTERPRET`` when a kernel is defined, so
    setting it later does not make those run on the CPU, and Triton's interpreter then fails in
    kernels defined after it too."""
    import sys

    triton = sys.modules.get("triton")
    if triton is None:
        return False
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction, KernelInterface

    def compiled(v) -> bool:
        while isinstance(v, KernelInterface) and not isinstance(v, (JITFunction, InterpretedFunction)):
            v = getattr(v, "fn", None)  # autotuners and heuristics wrap the kernel
        return type(v) is JITFunction  # @triton.jit's; Gluon's subclass is never interpreted

    # the modules that imported Triton as a name of their own: those that define kernels
    mods = [m for m in list(sys.modules.values()) if getattr(m, "__dict__", {}).get("triton") is triton]
    return any(compiled(v) for m in mods for v in list(vars(m).values()))


def check_out(out, shape: tuple, dtypes: tuple, device) -> None:
    """Preallocated outputs must be what the kernels write: contiguous, of ``shape`` and the given
    dtypes, on ``device`` (a kernel writing past a smaller buffer corrupts memory).

    Raises:
        ValueError: naming the expected and the given layout.
    """
    if len(out) != len(dtypes) or any(
            tuple(t.shape) != tuple(shape) or t.dtype != d or not t.is_contiguous() or t.device != torch.device(device)
            for t, d in zip(out, dtypes)):
        got = [(tuple(t.shape), t.dtype, t.is_contiguous(), str(t.device)) for t in out]
        raise ValueError(f"out must be {len(dtypes)} contiguous tensors of shape {tuple(shape)} and dtypes "
                         f"{[str(d) for d in dtypes]} on {device}; got (shape, dtype, contiguous, device) {got}")


def upload_ints(values: list[int], device) -> torch.Tensor:
    """``values`` as a 1-D int64 tensor on ``device``, queued without stalling the host.

    A CUDA copy from pageable host memory synchronises the stream before it starts (CUDA
    runtime API, "API synchronization behavior": pageable host-to-device transfers), so
    ``torch.tensor(values, device="cuda")`` makes the host wait for every kernel already queued
    (a whole prefill) before it launches the next. From pinned memory the copy is queued like a
    kernel; PyTorch's host allocator keeps the pinned block until the copy has run. Callers pack
    several small uploads into one and take views.

    Args:
        values: integers in the int64 range (Python or NumPy ints); device: any torch device (no
            pinning off CUDA).
    Returns:
        ``[len(values)]`` int64 on ``device``.
    Raises:
        ValueError: a value outside the int64 range (``torch.tensor``'s own error).
        TypeError: a float, complex or bool among the values (read as a whole: a bool beside
            ints counts as an int, as ``torch.tensor`` types it).
    """
    host = torch.tensor(values)  # typed by its values, so a float is refused, not truncated
    if host.numel() and (host.dtype.is_floating_point or host.dtype.is_complex or host.dtype == torch.bool):
        raise TypeError(f"upload_ints takes integers, got values of {host.dtype}")
    host = host.to(torch.int64)
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
