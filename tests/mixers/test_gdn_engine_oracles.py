"""specla's GDN verify and commit on a serving engine's data (``specla.mixers.gdn.serving``)
against the engines' own published Triton kernels, run here under Triton's interpreter.

The engines' kernel files come from the package registry at test time, at pinned versions, into a
per-user cache (``$SPECLA_ENGINE_CACHE``, default ``~/.cache/specla/engine-kernels``): ``pip
download --no-deps`` of one wheel each (SGLang's is 39 MB, vLLM's 239 MB: neither publishes an
sdist pip can fetch without building it), of which only the kernel files are kept. They are
imported by file; the two package-level helpers SGLang's kernel file imports (hardware probes)
and vLLM's Triton re-export are stubbed, nothing else. Without network the tests skip, saying so.

Oracles: SGLang 0.5.23's per-node tree verify (``fused_sigmoid_gating_delta_rule_update`` with
``retrieve_parent_token`` and ``intermediate_states_buffer``, as ``TritonGDNKernel.target_verify``
calls it; the committed state is the accepted node's snapshot) and its ReplaySSM fold (the
compact-record chain: ring-written raw inputs replayed on commit); vLLM 0.34.0's chain
speculative kernel (one state slot per draft position). Tolerances: the largest errors observed
(noted at each assertion) with a margin of about 10x.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest
import torch
import triton

from specla.mixers.gdn.serving import GDNRecordBuffers, empty_record_buffers, gdn_pool_commit, gdn_pool_verify

SGLANG = dict(name="sglang", version="0.5.23", platform="manylinux_2_34_x86_64", files={
    "recurrent": "sglang/kernels/ops/attention/linear/fused_sigmoid_gating_recurrent.py",
    "fold": "sglang/kernels/ops/attention/linear/gdn_replayssm_spec_fold.py",
})
VLLM = dict(name="vllm", version="0.34.0", platform="manylinux_2_28_x86_64", files={
    "chain": "vllm/third_party/flash_linear_attention/ops/fused_sigmoid_gating.py",
})
# pip's words for a registry it cannot reach (no route, no DNS, refused, timed out, proxy)
OFFLINE = ("NewConnectionError", "Name or service not known", "Temporary failure in name resolution",
           "Network is unreachable", "ConnectTimeout", "ReadTimeout", "Connection refused", "ProxyError",
           "No route to host", "Max retries exceeded")


def _cache_dir() -> Path:
    return Path(os.environ.get("SPECLA_ENGINE_CACHE", Path.home() / ".cache" / "specla" / "engine-kernels"))


def _kernel_files(engine: dict) -> dict[str, Path]:
    """The engine's kernel files, downloaded once per version into the cache (skips the test
    when the registry cannot be reached; fails on any other download error)."""
    root = _cache_dir() / f"{engine['name']}-{engine['version']}"
    paths = {key: root / rel for key, rel in engine["files"].items()}
    if all(p.exists() for p in paths.values()):
        return paths
    wheels = root / "wheel"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.11",
           "--platform", engine["platform"], "-d", str(wheels), f"{engine['name']}=={engine['version']}"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if run.returncode != 0:
        log = run.stdout + run.stderr
        if any(word in log for word in OFFLINE):
            pytest.skip(f"the package registry is unreachable: {engine['name']}=={engine['version']} could not be "
                        "downloaded (no network)")
        raise RuntimeError(f"pip download of {engine['name']}=={engine['version']} failed:\n{log[-2000:]}")
    (wheel,) = wheels.glob("*.whl")
    with zipfile.ZipFile(wheel) as zf:
        for rel in engine["files"].values():
            zf.extract(rel, root)
    wheel.unlink()  # the kernel files are all that is kept
    wheels.rmdir()
    return paths


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


@pytest.fixture(scope="module")
def sglang():
    """SGLang 0.5.23's GDN recurrent kernel module and its ReplaySSM fold module."""
    files = _kernel_files(SGLANG)
    no = lambda *a, **k: False  # noqa: E731  (no CUDA, HIP or Hopper here)
    stubs = {"sglang.kernels.jit.utils": dict(is_arch_support_pdl=no),
             "sglang.srt.utils": dict(get_device_sm=lambda: 0, is_cuda=no, is_gfx95_supported=no, is_hip=no,
                                      is_sm90_supported=no)}
    return types.SimpleNamespace(recurrent=_import_by_file("_oracle_sglang_recurrent", files["recurrent"], stubs),
                                 fold=_import_by_file("_oracle_sglang_fold", files["fold"], {}))


@pytest.fixture(scope="module")
def vllm():
    """vLLM 0.34.0's GDN gated-recurrence kernel module (its chain speculative path)."""
    files = _kernel_files(VLLM)
    import triton.language as tl

    return _import_by_file("_oracle_vllm_chain", files["chain"], {"vllm.triton_utils": dict(tl=tl, triton=triton)})


H, HV, K, V = 2, 4, 16, 16


def _layer(T_total: int, seed: int, hv: int = HV):
    """One layer's verify inputs as SGLang hands them over: q, k, v strided views of one packed
    projection ``[1, Ttot, ...]``, raw gate inputs ``a, b [Ttot, HV]``, ``A_log``, ``dt_bias``."""
    gen = torch.Generator().manual_seed(seed)
    mixed = torch.randn(T_total, 2 * H * K + hv * V, generator=gen)
    q, k, v = torch.split(mixed, [H * K, H * K, hv * V], dim=-1)
    q, k, v = q.view(1, T_total, H, K), k.view(1, T_total, H, K), v.view(1, T_total, hv, V)
    a = torch.randn(T_total, hv, generator=gen)
    b = torch.randn(T_total, hv, generator=gen)
    A_log = torch.rand(hv, generator=gen) * 2 - 1
    dt_bias = torch.randn(hv, generator=gen) * 0.5
    return dict(A_log=A_log, a=a, dt_bias=dt_bias, q=q, k=k, v=v, b=b)


def _pool(slots: int, seed: int, hv: int = HV) -> torch.Tensor:
    """A state pool ``[slots, HV, V, K]`` float32 of states of a decoded sequence's size."""
    return torch.randn(slots, hv, V, K, generator=torch.Generator().manual_seed(seed)) * 0.3


def _accept(paths: list[list[int]], width: int, draft_token_num: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's ``accept_index`` ``[N, width]`` (flat positions, -1 padded) and ``accept_lens``."""
    idx = torch.full((len(paths), width), -1, dtype=torch.int64)
    for n, p in enumerate(paths):
        idx[n, : len(p)] = torch.tensor(p) + n * draft_token_num
    return idx, torch.tensor([len(p) for p in paths], dtype=torch.int64)


def _specla(layer, pool, cache_indices, row_indices, qsl, steps, parents, paths, rows, hv=HV):
    """specla's verify and commit on the pool (a copy); returns ``o`` and the pool after the
    commit, and checks that the verify left the pool bit-identical."""
    pool = pool.clone()
    before = pool.clone()
    records = empty_record_buffers(rows, steps, H, hv, K, V, "cpu")
    o = gdn_pool_verify(softplus_beta=1.0, softplus_threshold=20.0, initial_state_source=pool,
                        initial_state_indices=cache_indices, use_qk_l2norm_in_kernel=True, cu_seqlens=qsl,
                        records=records, intermediate_state_indices=row_indices, cache_steps=steps,
                        retrieve_parent_token=parents, **layer)
    assert torch.equal(pool, before)  # the verify reads the pool only
    accept_index, accept_lens = _accept(paths, steps, steps)
    gdn_pool_commit(pool, cache_indices, records, row_indices, accept_index, accept_lens, steps)
    return o, pool


def _root_path(parents: list[int], node: int) -> list[int]:
    path = [node]
    while path[-1] != 0:
        path.append(parents[path[-1]])
    return path[::-1]


def test_tree_verify_and_commit_equal_sglang_per_node_snapshots(sglang):
    """Ragged 6-node trees (a different shape a row), rows whose root alone is accepted: specla's
    outputs and committed states against SGLang's tree verify and its snapshot commit."""
    D, N, slots = 6, 4, 7
    trees = [[-1, 0, 0, 1, 1, 2], [-1, 0, 1, 2, 3, 4], [-1, 0, 0, 0, 0, 0], [-1, 0, 1, 1, 3, 3]]
    leaves = [4, 5, 0, 5]  # row 2: the root alone is accepted
    paths = [_root_path(t, leaf) for t, leaf in zip(trees, leaves)]
    paths[3] = paths[3][:2]  # a path ending inside the tree
    layer = _layer(N * D, seed=0)
    pool = _pool(slots, seed=1)
    cache_indices = torch.tensor([5, 0, 3, 6], dtype=torch.int32)
    row_indices = torch.tensor([2, 0, 3, 1], dtype=torch.int32)  # record / scratch row of each request
    qsl = torch.arange(0, N * D + 1, D, dtype=torch.int32)
    parents = torch.tensor(trees, dtype=torch.int64)

    ref_pool = pool.clone()
    scratch = torch.zeros(N, D, HV, V, K)
    o_ref = sglang.recurrent.fused_sigmoid_gating_delta_rule_update(
        softplus_beta=1.0, softplus_threshold=20.0, initial_state_source=ref_pool, initial_state_indices=cache_indices,
        cu_seqlens=qsl, use_qk_l2norm_in_kernel=True, is_kda=False, disable_state_update=True,
        intermediate_states_buffer=scratch, intermediate_state_indices=row_indices, cache_steps=D,
        retrieve_parent_token=parents, **layer)
    assert torch.equal(ref_pool, pool)
    for n, p in enumerate(paths):  # SGLang's commit: the last accepted node's snapshot into the slot
        ref_pool[cache_indices[n]] = scratch[row_indices[n], p[-1]]

    o, committed = _specla(layer, pool, cache_indices, row_indices, qsl, D, parents, paths, N)
    assert (o - o_ref).abs().max() < 1e-6  # observed 1.0e-7 (outputs up to 0.24)
    assert (committed - ref_pool).abs().max() < 2e-6  # observed 1.2e-7
    assert torch.equal(committed[[1, 2, 4]], pool[[1, 2, 4]])  # slots of no row: untouched
