"""Compile every project kernel the CPU tests launch for a Hopper GPU (sm_90), on the CPU.

Triton's interpreter runs a kernel as Python: it accepts code that the compiler rejects (a global
that is not a ``constexpr``, a ``tl.arange`` of a length that is not a power of two), so a kernel
can pass every interpreted test and fail to compile on the GPU. :func:`install` wraps the interpreter's launch:
the first launch of each project kernel with a given signature (argument types and ``constexpr``
values) also compiles it with Triton's CUDA backend for ``sm_90`` (Triton's front end, LLVM and
``ptxas``; no GPU needed), and a kernel that does not compile fails the test that launched it with
the compiler's message. The compiles run in one worker process per test process (this file run as
a script, on the test process's ``sys.path``, so that it compiles the code under test), because
under ``TRITON_INTERPRET=1`` Triton's own library functions (``tl.max``, ...) are interpreted ones
that the compiler cannot take. Integer arguments equal to 1 are specialised to constants as
Triton's launcher does; the divisibility hints it adds are not (they change code generation, not
what compiles). A kernel must be a module attribute under its own name (the worker imports it).
FLA's kernels (interpreted by the oracle tests) are not ours and are not compiled.
``SPECLA_HOPPER_COMPILE=0`` turns it off.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import threading

TARGET = ("cuda", 90, 32)  # sm_90 (H100/H200), warp size 32

_seen: dict = {}
_lock = threading.Lock()
_worker: subprocess.Popen | None = None


class KernelDoesNotCompile(RuntimeError):
    """A project kernel that runs interpreted does not compile for the GPU."""


def _is_project(fn) -> bool:
    top = (getattr(fn, "__module__", "") or "").split(".")[0]
    return top == "specla" or top.startswith("specla_") or top == "plugins"


def _encode(v):
    """A ``constexpr`` value as JSON (Triton dtypes by name)."""
    import triton.language as tl

    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, tl.dtype):
        return {"tl_dtype": v.name}
    raise TypeError(f"cannot pass constexpr {v!r} to the compile worker")


def _decode(v):
    import triton.language as tl

    return getattr(tl, v["tl_dtype"]) if isinstance(v, dict) else v


def _request(fn, args, kwargs) -> dict:
    """One launch as a compile request: the kernel by module and name, argument types by name,
    ``constexpr`` values by name, compile options (``num_warps``, ...)."""
    from triton.runtime.jit import mangle_type

    params = list(inspect.signature(fn).parameters.values())
    names = [p.name for p in params]
    bound = dict(zip(names, args))
    options = {}
    for k, v in kwargs.items():
        (bound if k in names else options)[k] = v
    signature, constexprs = {}, {}
    for p in params:
        if p.name not in bound:
            if p.default is inspect.Parameter.empty:
                raise TypeError(f"{fn.__name__}: no value for {p.name}")
            bound[p.name] = p.default
        v = bound[p.name]
        if "constexpr" in str(p.annotation) or v is None:
            signature[p.name] = "constexpr"
            constexprs[p.name] = _encode(v)
        else:
            signature[p.name] = mangle_type(v, True)  # an int equal to 1 becomes a constant, as launched
            if signature[p.name] == "constexpr":
                constexprs[p.name] = _encode(v)
    return {"module": fn.__module__, "name": fn.__name__, "signature": signature,
            "constexprs": constexprs, "options": options}


def compile_request(req: dict):
    """Compile one request (:func:`_request`) for ``sm_90`` in this process, which must not run
    Triton's interpreter; returns Triton's compiled kernel (its ``asm["ptx"]``, ``metadata``)."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    fn = getattr(importlib.import_module(req["module"]), req["name"])
    while not isinstance(fn, JITFunction):  # @triton.heuristics / @triton.autotune wrap it
        fn = fn.fn
    src = ASTSource(fn=fn, signature=req["signature"], constexprs={k: _decode(v) for k, v in req["constexprs"].items()})
    return triton.compile(src, target=GPUTarget(*TARGET), options=req["options"] or None)


def _compile(req: dict) -> str | None:
    """Compile one request in this (compiling) process; the error's text, or ``None``."""
    sys.path[:0] = [p for p in req.get("path", ()) if p not in sys.path]  # the test process's, now
    try:
        compile_request(req)
        return None
    except Exception as e:  # the compiler's error types differ between Triton versions
        return f"{type(e).__name__}: {e}"


def _ask_worker(req: dict) -> str | None:
    global _worker
    if _worker is None or _worker.poll() is not None:
        _worker = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   text=True, env={**os.environ, "TRITON_INTERPRET": "0"})
    try:
        _worker.stdin.write(json.dumps(req) + "\n")
        _worker.stdin.flush()
        line = _worker.stdout.readline()
    except OSError:
        line = ""
    if not line:
        _worker.kill()
        _worker = None  # the next request starts a new one
        raise RuntimeError("the sm_90 compile worker (tests/hopper_compile.py) exited")
    return json.loads(line)["error"]


def compile_for_hopper(fn, args, kwargs) -> None:
    """Compile ``fn`` (the plain Python function of an interpreted kernel) for ``sm_90`` at this
    launch's signature, once per signature.

    Raises:
        KernelDoesNotCompile: Triton's compiler rejects the kernel (its message included).
    """
    req = _request(fn, args, kwargs)
    key = json.dumps(req, sort_keys=True)
    with _lock:
        if key not in _seen:
            # with the test process's import path: the worker compiles the code under test, not
            # another installed copy
            _seen[key] = _ask_worker({**req, "path": [p or os.getcwd() for p in sys.path]})
        err = _seen[key]
    if err is not None:
        raise KernelDoesNotCompile(f"{req['module']}.{req['name']} does not compile for sm_90 (signature "
                                   f"{req['signature']}, constexprs {req['constexprs']}): {err}")


def install() -> bool:
    """Wrap the interpreter's launch so that project kernels are also compiled for ``sm_90``.

    Returns:
        Whether the wrap was installed: under ``TRITON_INTERPRET=1``, with Triton's CUDA backend
        present, unless ``SPECLA_HOPPER_COMPILE=0``.
    """
    if os.environ.get("TRITON_INTERPRET") != "1" or os.environ.get("SPECLA_HOPPER_COMPILE") == "0":
        return False
    try:
        from triton.backends import backends
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return False
    if "nvidia" not in backends:
        return False
    run = InterpretedFunction.run
    if getattr(run, "_hopper_compile", False):
        return True

    def checked_run(self, *args, grid, warmup, **kwargs):
        if _is_project(self.fn):
            compile_for_hopper(self.fn, args, kwargs)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    checked_run._hopper_compile = True
    InterpretedFunction.run = checked_run
    return True


if __name__ == "__main__":  # the compile worker: one JSON request per line in, one answer out
    for line in sys.stdin:
        print(json.dumps({"error": _compile(json.loads(line))}), flush=True)
