"""Sweep of the GDN tree verify's product/commit precision and launch tiles on the engine's inputs."""
import os, sys, time
os.environ.setdefault('TRITON_PRINT_AUTOTUNING', '0')
import logging, itertools, torch, triton
from pathlib import Path
sys.path.insert(0, "benchmarks/scripts")
import engine_kernels_probe as ekp
from engine_kernels_probe import captured_inputs, first_rows, parents_of, tuned, us, GDN13B_SHAPE, PRESETS
import specla_gdn.verify as vk
from specla_gdn.naive import naive_tree_gdn
t0 = time.time()
DEV = sys.argv[1] if len(sys.argv) > 1 else "cuda"
ekp.CUDA = DEV == "cuda"
shapes = [("gdn-1.3b", 64), ("small", 32)] if ekp.CUDA else [("tiny", 2)]
COMBOS = [("ieee", "ieee"), ("tf32x3", "ieee"), ("tf32x3", "tf32x3"), ("split", "ieee"), ("split", "split"), ("tf32", "ieee"), ("tf32", "tf32")]

def f64_commit(S, pending):
    rec, path, plen = pending.record, pending.path, pending.path_len
    B, HV = S.shape[0], S.shape[1]
    H = rec.k.shape[2]
    out = S.double().clone()
    for b in range(B):
        n = int(plen[b])
        if n == 0: continue
        nodes = path[b, :n].long()
        Ga = rec.G[b, nodes[-1]].double()
        acc = S[b].double() * Ga.exp()[:, None, None]
        for j in nodes.tolist():
            w = (Ga - rec.G[b, j].double()).exp()
            kk = rec.k[b, j].double().repeat_interleave(HV // H, 0)
            acc += w[:, None, None] * kk[:, :, None] * rec.delta[b, j].double()[:, None, :]
        out[b] = acc
    return out

for name, B in shapes:
    shape = dict(num_hidden_layers=24, **GDN13B_SHAPE) if name == "gdn-1.3b" else PRESETS[name]["model"]
    cap = captured_inputs(shape, B, DEV)
    q, k, v, g, beta, S, mask, scale, pending = cap["verify"]
    print(f"## {name} B{B}: q {list(q.shape)} {q.dtype}, v {v.dtype}, pending path_len {pending.path_len[:8].tolist()}  [{time.time()-t0:.0f} s]", flush=True)
    # accuracy: first 4 sequences, with the pending commit, against float64
    n = min(4, B)
    one = [x[:n] for x in (q, k, v, g, beta)]
    pend = first_rows(pending, n)
    Sref = f64_commit(S[:n], pend)
    ro, rd, rG, _ = naive_tree_gdn(*(x.double() for x in one), Sref, parents_of(mask[:n]), scale)
    print("| products | commit | o | Delta | G | committed S |\n|---|---|---|---|---|---|")
    for dot, com in COMBOS:
        try:
          with tuned(vk.TUNING["tree"], dot=dot, commit=com):
            St = S[:n].clone()
            o, d, G = vk.tree_verify(*one, St, mask[:n], scale, pending=pend)
        except Exception as ex:
            print(f"| {dot} | {com} | fail {type(ex).__name__} |"); continue
        e = lambda a, r: float((a.double() - r).abs().max() / r.abs().max())
        print(f"| {dot} | {com} | {e(o, ro):.1e} | {e(d, rd):.1e} | {float((G.double()-rG).abs().max()):.1e} | {e(St, Sref):.1e} |", flush=True)
    # timing: combos at the default tiles, at B and 1
    for nb in (B, 1):
        args = [x[:nb] for x in (q, k, v, g, beta, S, mask)]
        pend = first_rows(pending, nb)
        cells = []
        for dot, com in COMBOS:
            try:
              with tuned(vk.TUNING["tree"], dot=dot, commit=com):
                cells.append(f"{dot}/{com} {us(lambda: vk.tree_verify(*args, scale, pending=pend))}")
            except Exception as ex:
                cells.append(f"{dot}/{com} fail")
        print(f"{name} B{nb} default tiles: " + ", ".join(cells), f" [{time.time()-t0:.0f} s]", flush=True)
    # tile sweep at B for the accurate combos
    args = [x[:B] for x in (q, k, v, g, beta, S, mask)]
    pend = first_rows(pending, B)
    print("| batch | products/commit | BV | BKC | warps | stages | us |\n|---|---|---|---|---|---|---|")
    for dot, com in [("split", "split"), ("tf32x3", "tf32x3")]:
        for bv, bkc, w, st in itertools.product((32, 64), (32, 64, 128), (4, 8), (2, 3)):
            if time.time() - t0 > float(sys.argv[2] if len(sys.argv) > 2 else 250) and name == "small": break
            try:
                with tuned(vk.TUNING["tree"], dot=dot, commit=com, BV=bv, BKC=bkc, num_warps=w, num_stages=st):
                    t = us(lambda: vk.tree_verify(*args, scale, pending=pend))
            except Exception as ex:
                t = f"fail {type(ex).__name__}"
            print(f"| {B} | {dot}/{com} | {bv} | {bkc} | {w} | {st} | {t} |", flush=True)
        if not ekp.CUDA: break
print(f"done [{time.time()-t0:.0f} s]")
