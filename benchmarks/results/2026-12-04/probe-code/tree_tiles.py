"""Tree-verify tiles at batch 1 (fused prepare) and at the large batch (separate), synthetic inputs."""
import sys, random, torch, triton
sys.path.insert(0, "tests")
import torch.nn.functional as F
import specla_gdn.verify as vk
from specla.tree import inclusive_ancestor_mask
from test_gdn_kernels import inputs, layer_commit
dev = "cuda" if torch.cuda.is_available() else "cpu"
rng = random.Random(3)
for name, (H, K, V, Bbig) in {"gdn-1.3b": (8, 256, 256, 64), "small": (4, 128, 256, 32)}.items():
    for B in (1, Bbig):
        T, Tp = 16, 16
        gen = torch.Generator().manual_seed(5)
        q, k, v, g, beta, S0 = (x.to(dev) for x in inputs(B, T, H, H, K, V, gen))
        v = v.bfloat16()
        parents = torch.tensor([[-1] + [rng.randrange(0, i) for i in range(1, T)] for _ in range(B)])
        mask = inclusive_ancestor_mask(parents).to(dev)
        pk = F.normalize(torch.randn(B, Tp, H, K, generator=gen), dim=-1).bfloat16()
        pend = layer_commit(pk, torch.randn(B, Tp, H, V, generator=gen), -(torch.rand(B, Tp, H, generator=gen) * 0.5).cumsum(1),
                            torch.tensor([[0, 2, 5, 9, -1, -1, -1]] * B), torch.full((B,), 4))
        cells = []
        for bv, bkc in ((32, 64), (64, 32), (32, 32), (64, 64)):
            saved = dict(vk.TUNING["tree"])
            vk.TUNING["tree"].update(BV=bv, BKC=bkc)
            fn = lambda: vk.tree_verify(q, k, v, g, beta, S0, mask, K**-0.5, pending=pend)
            t = round(triton.testing.do_bench_cudagraph(fn, rep=30) * 1e3, 1) if dev == "cuda" else fn() and 0
            vk.TUNING["tree"].update(saved)
            cells.append(f"BV{bv}/BKC{bkc} {t}")
        print(f"{name} B{B}: " + ", ".join(cells), flush=True)
