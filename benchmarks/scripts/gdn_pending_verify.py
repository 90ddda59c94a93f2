"""GDN verify kernels with a pending (fused delayed) commit at the GDN-1.3B layer shape (BENCHMARKS.md
section 5: the step-change table and the launch sweep).

    python benchmarks/scripts/gdn_pending_verify.py            # kernel table
    python benchmarks/scripts/gdn_pending_verify.py --sweep    # launch settings, one row per setting
    python benchmarks/scripts/gdn_pending_verify.py --shape small   # the `small` target's layer
    python benchmarks/scripts/gdn_pending_verify.py --writeback     # plain decoding's state write

One layer, H = HV = 8 heads, K = V = 256 (``--shape small``: H = HV = 4, K = 128, V = 256), q/k/v bfloat16, gates and state float32; the pending
commit is a path of ``P`` accepted nodes out of a previous step of 17 nodes. Times are device
times in µs (``triton.testing.do_bench_cudagraph``), for batches 1, 8 and 64 and ``(T, P)`` =
(1, 1), (7, 5), (16, 6), (17, 6), ``T`` counting the root.

Kernel table: the serial kernel (``serial_verify``), the tree-masked parallel kernel
(``tree_verify``) with the pending commit in its two forms (``TUNING["tree"]["prepare"]``:
``fused``, each program computes ``T = (I + A)^-1`` and ``G`` itself; ``separate``, a prepare
launch first, included in its time), without the pending commit (fused), and the separate prepare
kernel alone on 1, 2, 4 and 8 warps. ``--sweep``: the serial kernel of one-token passes (``TUNING["decode"]``:
V-tile width ``BV`` and warps) and the parallel kernel with a pending commit (``TUNING["tree"]``:
``BV``, warps and the prepare's form);
``TUNING`` is restored afterwards.

``--writeback``: whether writing the state back every ``L`` steps instead of every step (as vLLM's
cached recurrent inputs do, vllm#48792) could pay for plain decoding. The one-token pass of the
serial kernel (plain decoding's step) at batches 1 to 256 with a pending path of ``p = 0..8`` tokens
of one chain: ``p = 0`` reads the state and writes nothing (the kernel stores a state tile only
where a pending path is applied), ``p >= 1`` applies ``p`` tokens and stores the tile, as every
plain step does today with ``p = 1``. With ``W = t(1) - t(0)`` (the store and one token's apply),
a cycle of ``L`` steps that stores only at its last step costs at least
``sum_{p<L} (t(p) - W) + t(L)``: the row's ``L=...`` columns give that lower bound per step, so
``t(1)`` minus it bounds the saving per layer from above. One CUDA GPU.
"""
import argparse
import copy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from specla.records import LayerCommit
from specla.tree import inclusive_ancestor_mask
from specla.mixers.gdn.records import GDNFactorRecord
from specla.mixers.gdn import verify as vk

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from provenance import add_allow_dirty, print_meta  # noqa: E402

SHAPE = {"1.3b": (8, 256, 256), "small": (4, 128, 256)}  # (H = HV, K, V)
H = HV = 8
K = V = 256
SHAPES = ((1, 1), (7, 5), (16, 6), (17, 6))  # (T, P)


def make(B, T, Tp, P):
    """Random inputs of one verify pass: a chain of ``T`` nodes and a pending path of ``P`` of ``Tp``."""
    d = "cuda"
    q = F.normalize(torch.randn(B, T, H, K, device=d), dim=-1).bfloat16()
    k = F.normalize(torch.randn(B, T, H, K, device=d), dim=-1).bfloat16()
    v = torch.randn(B, T, HV, V, device=d).bfloat16()
    g = -torch.rand(B, T, HV, device=d) * 0.1
    beta = torch.rand(B, T, HV, device=d)
    S = torch.randn(B, HV, K, V, device=d) * 0.1
    pk = F.normalize(torch.randn(B, Tp, H, K, device=d), dim=-1).bfloat16()
    pd = torch.randn(B, Tp, HV, V, device=d) * 0.01
    pG = -torch.rand(B, Tp, HV, device=d).cumsum(1) * 0.1
    path = torch.arange(P, device=d).expand(B, P).contiguous()
    plen = torch.full((B,), P, device=d)
    parents = torch.arange(-1, T - 1, device=d).expand(B, T).contiguous()
    return q, k, v, g, beta, S, LayerCommit(GDNFactorRecord(k=pk, delta=pd, G=pG, conv_x=None), path, plen), parents


def us(f, rep=50):
    f()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(f, rep=rep) * 1e3


def kernel_table():
    print("| B | T | P | serial | parallel, fused | parallel, separate | fused, no pending | prepare w1 | w2 | w4 | w8 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for B in (1, 8, 64):
        for T, P in SHAPES:
            q, k, v, g, beta, S, pend, parents = make(B, T, 17, P)
            mask = inclusive_ancestor_mask(parents)
            n = torch.full((B,), T, device="cuda")
            res = {"serial": us(lambda: vk.serial_verify(q, k, v, g, beta, S, n, K**-0.5, pending=pend))}
            saved = vk.TUNING["tree"]["prepare"]
            try:
                for form in ("fused", "separate"):
                    vk.TUNING["tree"]["prepare"] = form
                    res[form] = us(lambda: vk.tree_verify(q, k, v, g, beta, S, mask, K**-0.5, pending=pend))
                res["nopend"] = us(lambda: vk.tree_verify(q, k, v, g, beta, S, mask, K**-0.5))  # fused
            finally:
                vk.TUNING["tree"]["prepare"] = saved
            m8 = mask.to(torch.int8)
            BT = max(16, triton.next_power_of_2(T))
            Tm = torch.empty(B * HV, BT, BT, device="cuda")
            G = torch.empty(B, T, HV, device="cuda")
            for w in (1, 2, 4, 8):
                res[f"w{w}"] = us(lambda: vk._tree_prepare_kernel[(B * HV,)](
                    k, g, beta, m8, Tm, G, None, None, None, None, None, T, SQK=H * K, SG=HV, D=T, sP=0, H=H, HV=HV,
                    K=K, BT=BT, BKC=64, DOT_PREC="tf32", L2NORM=False, num_warps=w))
            cols = ("serial", "fused", "separate", "nopend", "w1", "w2", "w4", "w8")
            print(f"| {B} | {T} | {P} | " + " | ".join(f"{res[c]:.1f}" for c in cols) + " |", flush=True)


def sweep():
    saved = copy.deepcopy(vk.TUNING)
    print("| kernel | B | T | setting | us |")
    print("|---|---|---|---|---|")
    try:
        for B in (1, 8, 64):
            for T, P in SHAPES[:3]:
                q, k, v, g, beta, S, pend, parents = make(B, T, 17, P)
                mask = inclusive_ancestor_mask(parents)
                n = torch.full((B,), T, device="cuda")
                if T == 1:
                    for bv in (8, 16, 32, 64):
                        for w in (1, 2, 4):
                            vk.TUNING["decode"] = {"BV": bv, "num_warps": w}
                            t = us(lambda: vk.serial_verify(q, k, v, g, beta, S, n, K**-0.5, pending=pend), rep=40)
                            print(f"| serial | {B} | {T} | BV{bv}/w{w} | {t:.1f} |", flush=True)
                    vk.TUNING["decode"] = dict(saved["decode"])
                    continue
                for bv in (16, 32, 64):
                    for w in (4, 8):
                        for form in ("fused", "separate"):
                            vk.TUNING["tree"] = {**saved["tree"], "tiles": {form: (bv, 64)}, "num_warps": w,
                                                 "prepare": form}
                            t = us(lambda: vk.tree_verify(q, k, v, g, beta, S, mask, K**-0.5, pending=pend), rep=40)
                            print(f"| parallel | {B} | {T} | BV{bv}/w{w}/{form} | {t:.1f} |", flush=True)
                vk.TUNING["tree"] = dict(saved["tree"])
    finally:
        vk.TUNING.clear()
        vk.TUNING.update(saved)


def writeback():
    print("| B | " + " | ".join(f"t({p})" for p in range(9)) + " | L=2 | L=4 | L=8 | state MiB |")
    print("|---|" + "---|" * 13)
    for B in (1, 8, 32, 64, 128, 256):
        q, k, v, g, beta, S, pend, _ = make(B, 1, 8, 8)
        n = torch.ones(B, dtype=torch.int64, device="cuda")
        t = []
        for p in range(9):  # a path of the first p nodes of the pending chain
            lc = LayerCommit(pend.record, pend.path, torch.full((B,), p, device="cuda"))
            t.append(us(lambda: vk.serial_verify(q, k, v, g, beta, S, n, K**-0.5, pending=lc)))
        w = t[1] - t[0]
        cycle = {L: (sum(t[p] - w for p in range(1, L)) + t[L]) / L for L in (2, 4, 8)}
        print(f"| {B} | " + " | ".join(f"{x:.1f}" for x in t) + " | " + " | ".join(f"{c:.1f}" for c in cycle.values())
              + f" | {S.numel() * 4 / 2**20:.0f} |", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", action="store_true", help="time launch settings instead of the kernel table")
    ap.add_argument("--writeback", action="store_true", help="time plain decoding's step with and without its "
                    "state write (see the module docstring)")
    ap.add_argument("--shape", choices=sorted(SHAPE), default="1.3b", help="layer shape (default 1.3b)")
    a = add_allow_dirty(ap).parse_args()
    global H, HV, K, V
    H, K, V = SHAPE[a.shape]
    HV = H
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    print_meta("cuda", a.allow_dirty)
    sweep() if a.sweep else writeback() if a.writeback else kernel_table()


if __name__ == "__main__":
    main()
