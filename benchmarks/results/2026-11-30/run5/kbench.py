"""GDN verify kernels with a pending commit at the 1.3B layer shape; tree-prepare warps sweep."""
import torch, torch.nn.functional as F, triton
from specla_gdn import verify as vk
from specla.tree import inclusive_ancestor_mask
H = HV = 8; K = V = 256
def make(B, T, Tp, P):
    d = "cuda"
    q = F.normalize(torch.randn(B, T, H, K, device=d), dim=-1).bfloat16()
    k = F.normalize(torch.randn(B, T, H, K, device=d), dim=-1).bfloat16()
    v = torch.randn(B, T, HV, V, device=d).bfloat16()
    g = -torch.rand(B, T, HV, device=d) * 0.1; beta = torch.rand(B, T, HV, device=d)
    S = torch.randn(B, HV, K, V, device=d) * 0.1
    pk = F.normalize(torch.randn(B, Tp, H, K, device=d), dim=-1).bfloat16()
    pd = torch.randn(B, Tp, HV, V, device=d) * 0.01; pG = -torch.rand(B, Tp, HV, device=d).cumsum(1) * 0.1
    path = torch.arange(P, device=d).expand(B, P).contiguous(); plen = torch.full((B,), P, device=d)
    parents = torch.arange(-1, T - 1, device=d).expand(B, T).contiguous()
    return q, k, v, g, beta, S, (pk, pd, pG, path, plen), parents
print("| B | T | P | serial | parallel | parallel, no pending | prepare w1 | w2 | w4 | w8 |")
print("|---|---|---|---|---|---|---|---|---|---|")
for B in (1, 8, 64):
    for T, P in ((1, 1), (7, 5), (16, 6), (17, 6)):
        q, k, v, g, beta, S, pend, parents = make(B, T, 17, P)
        mask = inclusive_ancestor_mask(parents)
        n = torch.full((B,), T, device="cuda")
        res = {}
        fns = {"serial": lambda: vk.serial_verify(q, k, v, g, beta, S, n, K**-0.5, pending=pend),
               "dot": lambda: vk.tree_verify(q, k, v, g, beta, S, mask, K**-0.5, pending=pend),
               "nopend": lambda: vk.tree_verify(q, k, v, g, beta, S, mask, K**-0.5)}
        for name, f in fns.items():
            f(); torch.cuda.synchronize()
            res[name] = triton.testing.do_bench_cudagraph(f, rep=50)
        m8 = mask.to(torch.int8); BT = max(16, triton.next_power_of_2(T))
        Tm = torch.empty(B * HV, BT, BT, device="cuda"); G = torch.empty(B, T, HV, device="cuda")
        for w in (1, 2, 4, 8):
            f = lambda: vk._tree_prepare_kernel[(B * HV,)](k, g, beta, m8, Tm, G, T, H=H, HV=HV, K=K, BT=BT, BKC=64,
                                                           DOT_PREC="tf32", num_warps=w)
            f(); torch.cuda.synchronize()
            res[f"w{w}"] = triton.testing.do_bench_cudagraph(f, rep=50)
        print(f"| {B} | {T} | {P} | " + " | ".join(f"{res[x]*1e3:.1f}" for x in ("serial", "dot", "nopend", "w1", "w2", "w4", "w8")) + " |", flush=True)
