"""The linear layers of a decoding step at few rows: cuBLAS with the step's glue as separate
launches, against ``skinny_linear.skinny_linear`` (beside this script; not kept in specla) with the glue fused, at the
GDN-1.3B shapes (BENCHMARKS.md section 5).

    python benchmarks/results/2026-12-04/probe-code/skinny_linear_sweep.py            # the table at TUNING
    python benchmarks/results/2026-12-04/probe-code/skinny_linear_sweep.py --sweep    # every launch setting too
    python benchmarks/results/2026-12-04/probe-code/skinny_linear_sweep.py --chain --pdl   # 24 blocks; PDL column

One H200-class GPU, bfloat16. Each row is one GDN-1.3B block's linear layer as the adapter runs it
(``w_in``: RMSNorm, then the stacked input projections; ``w_o``: the output projection added into
the residual; ``w_gu``: RMSNorm, then the stacked gate/up projection; ``w_down``: SwiGLU, then the
down projection added into the residual; ``lm_head``: final RMSNorm, then the LM head). Times are
µs per layer, the median of 5 replays of a CUDA graph that runs the layer on 24 distinct weight
copies in turn (the LM head on 4; more bytes than the L2 holds, as a step's 24 layers), and the weight's effective
bandwidth in TB/s. ``--sweep`` prints every ``(BN, BK, warps, stages)`` and the best per row.
"""
import argparse
import itertools
import os
import statistics
import sys

import torch

from specla.ops import act_triton, norm_triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import skinny_linear as lt  # noqa: E402

HIDDEN, INTER, DC, HV, VOCAB = 2048, 5632, 6144, 8, 32000
ROWS = {"w_in": (DC + 2 * HV + HIDDEN, HIDDEN, "norm"), "w_o": (HIDDEN, HIDDEN, "res"),
        "w_gu": (2 * INTER, HIDDEN, "norm"), "w_down": (HIDDEN, INTER, "swiglu"),
        "lm_head": (VOCAB, HIDDEN, "norm")}
COPIES = 24


def inputs(name, M):
    """The weight copies and the layer's inputs for ``M`` rows."""
    N, K, kind = ROWS[name]
    d, dt = "cuda", torch.bfloat16
    ws = [(torch.randn(N, K, device=d) / K ** 0.5).to(dt) for _ in range(COPIES if name != "lm_head" else 4)]
    x = torch.randn(M, 2 * K if kind == "swiglu" else K, device=d, dtype=dt)
    nw = torch.rand(K, device=d, dtype=dt) + 0.5
    res = torch.randn(M, N, device=d, dtype=dt)
    return ws, x, nw, res, kind


def baseline(w, x, nw, res, kind):
    """The adapter's launches before the fused form: Triton RMSNorm / SwiGLU, then cuBLAS."""
    if kind == "norm":
        return norm_triton.rms_norm(x, nw, 1e-6) @ w.T
    if kind == "swiglu":
        return res.addmm_(act_triton.swiglu(x, x.shape[1] // 2), w.T)
    return res.addmm_(x, w.T)


def fused(w, x, nw, res, kind):
    return lt.skinny_linear(x, w, norm=(nw, 1e-6) if kind == "norm" else None, swiglu=kind == "swiglu",
                            residual=res if kind in ("res", "swiglu") else None)


def graph_ms(body, samples):
    """ms per replay of a CUDA graph of ``body()`` (run once eagerly first): the median of
    ``samples`` timings of 10 replays each."""
    body()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
    g.replay()
    torch.cuda.synchronize()
    out = []
    for _ in range(samples):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(10):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) / 10)
    return statistics.median(out)


def time_us(fn, ws, x, nw, res, kind):
    """µs per call, median of 5 replays of a graph over every weight copy."""
    def body():
        for w in ws:
            fn(w, x, nw, res, kind)
    return graph_ms(body, 5) * 1e3 / len(ws)


def check(ws, x, nw, res, kind):
    """Largest difference from the twin in units of the output's bf16 spacing near 1 (2^-8)."""
    r1, r2 = res.clone(), res.clone()
    y = fused(ws[0], x, nw, r1, kind)
    ref = lt.skinny_linear_reference(x, ws[0], norm=(nw, 1e-6) if kind == "norm" else None,
                                     swiglu=kind == "swiglu", residual=r2 if kind in ("res", "swiglu") else None)
    return ((y.float() - ref.float()).abs() / ref.float().abs().clamp_min(1.0)).max().item() * 256


def chain(M, how):
    """ms per pass of 24 GDN-1.3B blocks' linear layers at ``M`` rows (the mixer left out: its
    input is the first 2048 columns of ``w_in``'s output), ``how``: "cublas", "fused", "pdl"."""
    d, dt = "cuda", torch.bfloat16
    L = [{n: (torch.randn(ROWS[n][0], ROWS[n][1], device=d) / ROWS[n][1] ** 0.5).to(dt) for n in ROWS if n != "lm_head"}
         for _ in range(24)]
    nw = torch.rand(HIDDEN, device=d, dtype=dt) + 0.5
    h = torch.randn(M, HIDDEN, device=d, dtype=dt)
    lt.TUNING["pdl"] = how == "pdl"

    def step():
        for w in L:
            if how == "cublas":
                z = norm_triton.rms_norm(h, nw, 1e-6) @ w["w_in"].T
                h.addmm_(z[:, :HIDDEN], w["w_o"].T)
                gu = norm_triton.rms_norm(h, nw, 1e-6) @ w["w_gu"].T
                h.addmm_(act_triton.swiglu(gu, INTER), w["w_down"].T)
            else:
                z = lt.skinny_linear(h, w["w_in"], norm=(nw, 1e-6))
                lt.skinny_linear(z[:, :HIDDEN], w["w_o"], residual=h)
                gu = lt.skinny_linear(h, w["w_gu"], norm=(nw, 1e-6))
                lt.skinny_linear(gu, w["w_down"], swiglu=True, residual=h)
            h.mul_(0.5)  # keeps the residual stream bounded over repeats

    ms = graph_ms(step, 7)
    lt.TUNING["pdl"] = False
    return ms


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--pdl", action="store_true", help="a column with programmatic dependent launch")
    ap.add_argument("--chain", action="store_true", help="24 blocks' linear layers in one graph, per form")
    a = ap.parse_args()
    keep = dict(lt.TUNING)
    if a.chain:
        for M in [int(m) for m in a.rows.split(",")]:
            print("chain M", M, {how: round(chain(M, how), 4) for how in ("cublas", "fused", "pdl")}, "ms", flush=True)
    print(f"{'layer':8} {'M':>3} {'cuBLAS+glue us':>14} {'TB/s':>5} {'fused us':>9} {'TB/s':>5} {'x':>5} {'err/ulp':>7}")
    best = {}
    for name, M in itertools.product(ROWS, [int(m) for m in a.rows.split(",")]):
        ws, x, nw, res, kind = inputs(name, M)
        gb = ws[0].numel() * 2 / 1e3  # kB -> TB/s from µs
        t0 = time_us(baseline, ws, x, nw, res, kind)
        t1 = time_us(fused, ws, x, nw, res, kind)
        err = check(ws, x, nw, res, kind)
        extra = ""
        if a.pdl:
            lt.TUNING["pdl"] = True
            t2 = time_us(fused, ws, x, nw, res, kind)
            extra = f" pdl {t2:7.2f} us {gb / t2 / 1e3:5.2f} TB/s err {check(ws, x, nw, res, kind):5.2f}"
            lt.TUNING["pdl"] = False
        print(f"{name:8} {M:3d} {t0:14.2f} {gb / t0 / 1e3:5.2f} {t1:9.2f} {gb / t1 / 1e3:5.2f} {t0 / t1:5.2f} {err:7.2f}"
              + extra, flush=True)
        if a.sweep:
            tk = "swiglu" if kind == "swiglu" else "norm" if kind == "norm" else "plain"
            for BN, BK, warps, stages in itertools.product((16, 32, 64, 128), (128, 256, 512), (4, 8), (3, 4)):
                lt.TUNING[tk] = (BN, BK, warps, stages)
                try:
                    t = time_us(fused, ws, x, nw, res, kind)
                except Exception as e:  # noqa: BLE001 - a setting that does not compile is reported
                    print(f"   {(BN, BK, warps, stages)} failed: {type(e).__name__}")
                    continue
                print(f"   {name} M{M} {(BN, BK, warps, stages)} {t:8.2f}", flush=True)
                if t < best.get((name, M), (1e9,))[0]:
                    best[(name, M)] = (t, (BN, BK, warps, stages))
            lt.TUNING.update(keep)
        del ws
        torch.cuda.empty_cache()
    for key, (t, cfg) in best.items():
        print(f"best {key}: {t:.2f} us at {cfg}")


if __name__ == "__main__":
    main()
