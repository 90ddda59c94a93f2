"""Launch settings of GDN's parallel (with pending commit) and serial (T = 1, pending) verify at the 1.3B layer shape."""
import sys, torch, triton
sys.path.insert(0, ".runs")
from kbench import make, K
from specla_gdn import verify as vk
from specla.tree import inclusive_ancestor_mask
print("| kernel | B | T | setting | us |"); print("|---|---|---|---|---|")
for B in (1, 8, 64):
    for T, P in ((1, 1), (7, 5), (16, 6)):
        q, k, v, g, beta, S, pend, parents = make(B, T, 17, P)
        mask = inclusive_ancestor_mask(parents); n = torch.full((B,), T, device="cuda")
        if T == 1:
            for bv in (4, 8, 16):
                for w in (1, 2, 4):
                    vk.TUNING["serial"] = {"BV": bv, "num_warps": w}
                    f = lambda: vk.serial_verify(q, k, v, g, beta, S, n, K**-0.5, pending=pend)
                    f(); torch.cuda.synchronize()
                    print(f"| serial | {B} | {T} | BV{bv}/w{w} | {triton.testing.do_bench_cudagraph(f, rep=40)*1e3:.1f} |", flush=True)
            vk.TUNING["serial"] = {"BV": 8, "num_warps": 1}
            continue
        for bv in (16, 32, 64):
            for w in (4, 8):
                vk.TUNING["tree"] = {"BV": bv, "BKC": 64, "num_warps": w}
                f = lambda: vk.tree_verify(q, k, v, g, beta, S, mask, K**-0.5, pending=pend)
                f(); torch.cuda.synchronize()
                print(f"| parallel | {B} | {T} | BV{bv}/w{w} | {triton.testing.do_bench_cudagraph(f, rep=40)*1e3:.1f} |", flush=True)
        vk.TUNING["tree"] = {"BV": 32, "BKC": 64, "num_warps": 8}
