"""Probe: GDN tree verify's dot precision and prepare form, and tree conv tiles, on engine tensors."""
import os, sys
import torch, triton
sys.path.insert(0, "benchmarks"); sys.path.insert(0, "benchmarks/scripts"); sys.path.insert(0, "benchmarks/targets"); sys.path.insert(0, ".work")
from e2e import GDN13B_SHAPE
from train_target import PRESETS
from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM
from specla import SpecDecoder
from specla.drafters.eagle import EagleDrafter, EagleHead
from specla.ops.conv import conv_ancestors
import specla_gdn.mixer as M
import specla_gdn.verify as vk
from specla_gdn.naive import naive_tree_gdn
import specla.ops.conv_triton as ct
import conv_old, conv_var

CPU = os.environ.get("DRY") == "1"
DEV = "cpu" if CPU else "cuda"
cap = {}
o_tv, o_tc = M.tree_verify, ct.tree_conv
def capturing():
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
def tv(q, k, v, g, beta, state, mask, scale, pending=None, out=None):
    if pending is not None and "tv" not in cap and not capturing():
        cap["tv"] = (q, k, v, g, beta, state, mask, scale, pending)
    return o_tv(q, k, v, g, beta, state, mask, scale, pending=pending, out=out)
def tc(x, window, weight, bias, anc, out=None):
    if x.shape[1] == 16 and "tc" not in cap and not capturing():
        cap["tc"] = (x, window, weight, bias, anc)
    return o_tc(x, window, weight, bias, anc, out=out)
M.tree_verify, ct.tree_conv = tv, tc

def us(f):
    if CPU:
        f(); return 0.0
    return round(triton.testing.do_bench_cudagraph(f, rep=30) * 1e3, 1)

def run_tv(q, k, v, g, beta, S, mask, scale, pending, prec, form):
    """tree_verify's host code with the dot precision and prepare form given."""
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    v, SV = vk._value_rows(v)
    BT = max(16, triton.next_power_of_2(T))
    BKC = max(16, min(triton.next_power_of_2(K), vk.TUNING["tree"]["BKC"]))
    BV = max(16, min(triton.next_power_of_2(V), vk.TUNING["tree"]["BV"]))
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    d = torch.empty(B, T, HV, V, dtype=torch.float32, device=v.device)
    G = torch.empty(B, T, HV, dtype=torch.float32, device=v.device)
    Tm = None if form == "fused" else torch.empty(B * HV, BT, BT, dtype=torch.float32, device=v.device)
    if form != "fused":
        vk._tree_prepare_kernel[(B * HV,)](k, g, beta, mask, Tm, G, T, H=H, HV=HV, K=K, BT=BT, BKC=BKC, DOT_PREC=prec,
                                           num_warps=vk.TUNING["prepare"]["num_warps"])
    pend = vk._pending_kwargs(pending)
    vk._tree_verify_kernel[(B * HV, triton.cdiv(V, BV))](
        q, k, v, g, beta, mask, Tm, G, S, o, d, scale=scale, T=T, SV=SV, H=H, HV=HV, K=K, V=V, BT=BT, BKC=BKC, BV=BV,
        DOT_PREC=prec, BP=max(16, triton.next_power_of_2(pend["P"])), **pend, num_warps=vk.TUNING["tree"]["num_warps"])
    return o, d, G

def sl(x, n):
    return x if x is None else x[:n]

SHAPES = [x for x in (("small", 32), ("1.3b", 64)) if x[0] in os.environ.get("PROBE_SHAPES", "small,1.3b").split(",")]
for shape_name, B in (SHAPES if not CPU else (("tiny", 2),)):
    cap.clear()
    torch.manual_seed(0)
    shape = dict(num_hidden_layers=24, **GDN13B_SHAPE) if shape_name == "1.3b" else PRESETS[shape_name]["model"]
    dt = torch.float32 if CPU else torch.bfloat16
    model = GatedDeltaNetForCausalLM(GatedDeltaNetConfig(vocab_size=32000, **shape)).to(DEV, dt).eval()
    head = EagleHead(model.config.hidden_size)
    prompts = [torch.randint(0, 32000, (69,)).tolist() for _ in range(B)]
    dec = SpecDecoder(model, "gdn", drafter=EagleDrafter(head), config=dict(
        dtype=str(dt).split(".")[1], device=DEV, cuda_graphs="unrecorded" if CPU else "on", max_new_tokens=4,
        stop_at_eos=False, budget_policy="fixed", num_draft_tokens=15, max_depth=6, top_k=4,
        **(dict(kernels="triton") if CPU else {})))
    dec.generate(prompts)
    q, k, v, g, beta, S, mask, scale, pend = cap["tv"]
    print(shape_name, "q", q.dtype, tuple(q.shape), "v", v.dtype, "S", tuple(S.shape), flush=True)
    from specla.records import LayerCommit
    for Bs in (B, 1):
        pb = LayerCommit(type(pend.record)(**{f: sl(getattr(pend.record, f), Bs) for f in ("k", "delta", "G", "conv_x")}),
                         pend.path[:Bs], pend.path_len[:Bs])
        args = [x[:Bs] for x in (q, k, v, g, beta, S, mask)]
        row = {}
        for form in ("separate", "fused"):
            for prec in ("ieee", "tf32", "tf32x3"):
                row[f"{form}/{prec}"] = us(lambda: run_tv(*args[:7], scale, pb, prec, form))
        print(f"| tree verify {shape_name} B{Bs} T{q.shape[1]} |", " | ".join(f"{a} {b}" for a, b in row.items()), "|", flush=True)
    # accuracy, no pending commit, one sequence, against the float64 twin on the same inputs
    a1 = [x[:1] for x in (q, k, v, g, beta)]
    S1 = S[:1].clone()
    parents = torch.full((1, q.shape[1]), -1, dtype=torch.int64, device=DEV)
    m1 = mask[:1]
    for i in range(q.shape[1]):  # parent = deepest strict ancestor
        anc = [j for j in range(i) if bool(m1[0, i, j])]
        parents[0, i] = max(anc) if anc else -1
    ro, rd, rG, _ = naive_tree_gdn(*(x.double() for x in a1), S1.double(), parents, scale)
    for prec in ("ieee", "tf32", "tf32x3"):
        for form in ("separate", "fused"):
            o, d, G = run_tv(*a1, S1.clone(), m1, scale, None, prec, form)
            eo = float((o.double() - ro).abs().max() / ro.abs().max())
            ed = float((d.double() - rd).abs().max() / rd.abs().max())
            print(f"| accuracy {shape_name} {prec}/{form} | o {eo:.2e} | delta {ed:.2e} | G {float((G.double() - rG).abs().max()):.1e} |", flush=True)
    if os.environ.get("SKIP_CONV"):
        continue
    x, win, w, b, anc = cap["tc"]
    D = x.shape[-1]
    cases = {f"engine B{B} T16": (x, win, w, b, anc), "engine B1 T16": tuple(sl(t, 1) if t is not w and t is not b else t for t in (x, win, w, b, anc))}
    for Bc in (1, B):
        xs = torch.randn(Bc, 1, D + 512, device=DEV, dtype=x.dtype)[..., :D]
        cases[f"fresh B{Bc} T1"] = (xs, torch.randn(Bc, win.shape[1], D, device=DEV, dtype=x.dtype), w, b,
                                    conv_ancestors(torch.full((Bc, 1), -1, device=DEV), w.shape[1]))
    for name, cargs in cases.items():
        ref = conv_old.tree_conv(*cargs)
        row = {"old": us(lambda: conv_old.tree_conv(*cargs))}
        for mod, tag in ((ct, "masked"), (conv_var, "select")):
            for rows, tile in ((4, 1024), (16, 2048), (8, 2048)):
                mod.TUNING.update(rows=rows, BD=256, tile=tile)
                row[f"{tag}/r{rows}/t{tile}"] = us(lambda: mod.tree_conv(*cargs))
                assert torch.equal(mod.tree_conv(*cargs), ref), (name, tag, rows, tile)
        print(f"| conv {shape_name} {name} |", " | ".join(f"{a} {b}" for a, b in row.items()), "|", flush=True)
    del dec, model, cap["tv"], cap["tc"]
    torch.cuda.empty_cache() if not CPU else None
