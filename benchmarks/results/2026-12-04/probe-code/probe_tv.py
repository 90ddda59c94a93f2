"""Probe: GDN tree verify / tree conv / prepare at batch B inside the engine vs fresh inputs."""
import os, sys
import torch, triton
sys.path.insert(0, "benchmarks"); sys.path.insert(0, "benchmarks/scripts"); sys.path.insert(0, "benchmarks/targets")
from e2e import GDN13B_SHAPE
from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM
from specla import SpecDecoder
from specla.drafters.eagle import EagleDrafter, EagleHead
import specla_gdn.mixer as M
import specla_gdn.verify as vk
import specla.ops.conv_triton as ct
import gdn_pending_verify as pv

B = int(sys.argv[1]) if len(sys.argv) > 1 else 64
CPU = os.environ.get("DRY") == "1"
DEV = "cpu" if CPU else "cuda"
cap = {}
o_tv, o_tc = M.tree_verify, ct.tree_conv
def desc(x):
    return None if x is None else [str(x.dtype), list(x.shape), list(x.stride()), x.is_contiguous(), x.storage_offset(),
                                   x.untyped_storage().nbytes()]
def tv(q, k, v, g, beta, state, mask, scale, pending=None, out=None):
    if pending is not None and "tv" not in cap and not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        cap["tv"] = (q, k, v, g, beta, state, mask, scale, pending)
    return o_tv(q, k, v, g, beta, state, mask, scale, pending=pending, out=out)
def tc(x, window, weight, bias, anc, out=None):
    if x.shape[1] == 16 and "tc" not in cap and not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        cap["tc"] = (x, window, weight, bias, anc)
    return o_tc(x, window, weight, bias, anc, out=out)
M.tree_verify, ct.tree_conv = tv, tc

torch.manual_seed(0)
shape = dict(hidden_size=96, num_heads=2, head_dim=32, expand_v=1, num_hidden_layers=2) if CPU else dict(num_hidden_layers=24, **GDN13B_SHAPE)
model = GatedDeltaNetForCausalLM(GatedDeltaNetConfig(vocab_size=32000, **shape)).to(DEV, torch.float32 if CPU else torch.bfloat16).eval()
head = EagleHead(model.config.hidden_size)
prompts = [torch.randint(0, 32000, (69,)).tolist() for _ in range(B)]
dec = SpecDecoder(model, "gdn", drafter=EagleDrafter(head), config=dict(dtype="float32" if CPU else "bfloat16", device=DEV, cuda_graphs="unrecorded" if CPU else "on",
                  max_new_tokens=8, stop_at_eos=False, budget_policy="fixed", num_draft_tokens=15, max_depth=6, top_k=4, **(dict(kernels="triton") if CPU else {})))
dec.generate(prompts)
print("captured", list(cap))
def us(f):
    if CPU:
        f(); return 0.0
    return round(triton.testing.do_bench_cudagraph(f, rep=40) * 1e3, 1)
def clone(x):
    if x is None: return None
    y = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device); y.copy_(x); return y
res = {}
q, k, v, g, beta, S, mask, scale, pend = cap["tv"]
for n, x in dict(q=q, k=k, v=v, g=g, beta=beta, S=S, mask=mask, pk=pend.record.k, pdelta=pend.record.delta, pG=pend.record.G,
                 path=pend.path, plen=pend.path_len).items():
    print(n, desc(x))
print("path", pend.path[:4].tolist(), pend.path_len[:8].tolist())
print("S absmax", S.abs().max().item(), "finite", torch.isfinite(S).all().item(), "q finite", torch.isfinite(q.float()).all().item(),
      "pdelta finite", torch.isfinite(pend.record.delta).all().item(), "pG", pend.record.G.min().item())
T = q.shape[1]
if CPU:
    pv.H = pv.HV = q.shape[2]; pv.K = pv.V = q.shape[3]
    import inspect
    pv.DEV = DEV
    exec(inspect.getsource(pv.make).replace('"cuda"', 'DEV'), pv.__dict__)
fq, fk, fv, fg, fb, fS, fpend, parents = pv.make(B, T, pend.record.k.shape[1], pend.path.shape[1])
from specla.tree import inclusive_ancestor_mask
fmask = inclusive_ancestor_mask(parents)
for form in ("separate", "fused"):
    vk.TUNING["tree"]["prepare"] = form
    res[f"tv engine tensors/{form}"] = us(lambda: o_tv(q, k, v, g, beta, S, mask, scale, pending=pend))
    res[f"tv fresh make()/{form}"] = us(lambda: o_tv(fq, fk, fv, fg, fb, fS, fmask, scale, pending=fpend))
    res[f"tv engine, fresh S/{form}"] = us(lambda: o_tv(q, k, v, g, beta, fS, mask, scale, pending=pend))
    res[f"tv fresh, engine S/{form}"] = us(lambda: o_tv(fq, fk, fv, fg, fb, S, fmask, scale, pending=fpend))
    res[f"tv engine, no pending/{form}"] = us(lambda: o_tv(q, k, v, g, beta, S, mask, scale))
    res[f"tv engine, fresh pending/{form}"] = us(lambda: o_tv(q, k, v, g, beta, S, mask, scale, pending=fpend))
    res[f"tv engine, fresh v/{form}"] = us(lambda: o_tv(q, k, fv, g, beta, S, mask, scale, pending=pend))
    res[f"tv engine, fresh mask/{form}"] = us(lambda: o_tv(q, k, v, g, beta, S, fmask, scale, pending=pend))
    res[f"tv engine, fresh g beta/{form}"] = us(lambda: o_tv(q, k, v, fg, fb, S, mask, scale, pending=pend))
vk.TUNING["tree"]["prepare"] = "auto"
x, win, w, b, anc = cap["tc"]
for n, t in dict(x=x, window=win, weight=w, bias=b, anc=anc).items():
    print(n, desc(t))
res["tree_conv engine"] = us(lambda: o_tc(x, win, w, b, anc))
xc = x.contiguous()
res["tree_conv x contiguous"] = us(lambda: o_tc(xc, win, w, b, anc))
for bd in (64, 128, 512, 1024):
    pass
for k_, v_ in res.items():
    print(f"| {k_} | {v_} |", flush=True)

# tree conv: the committed kernel (HEAD) against the working tree's tiles
sys.path.insert(0, ".work")
import conv_old
D = x.shape[-1]
cases = {"engine B%d T%d" % (x.shape[0], x.shape[1]): (x, win, w, b, anc)}
for Bc, Tc in ((1, 16), (64, 1), (1, 1), (64, 16)):
    xs = torch.randn(Bc, Tc, D + 512, device=DEV, dtype=x.dtype)[..., :D]
    par = torch.arange(-1, Tc - 1, device=DEV).expand(Bc, Tc).contiguous()
    from specla.ops.conv import conv_ancestors
    cases[f"fresh chain B{Bc} T{Tc}"] = (xs, torch.randn(Bc, win.shape[1], D, device=DEV, dtype=x.dtype), w, b,
                                       conv_ancestors(par, w.shape[1]))
saved = dict(ct.TUNING)
for name, args in cases.items():
    row = {"old": us(lambda: conv_old.tree_conv(*args))}
    ref = conv_old.tree_conv(*args)
    for rows, bd, tile in ((16, 256, 2048), (16, 256, 4096), (16, 256, 1024), (8, 256, 2048), (4, 256, 2048), (1, 256, 2048), (16, 512, 8192)):
        ct.TUNING.update(rows=rows, BD=bd, tile=tile)
        row[f"r{rows}/bd{bd}/t{tile}"] = us(lambda: o_tc(*args))
        if not CPU:
            assert torch.equal(o_tc(*args), ref), (name, rows, bd, tile)
    ct.TUNING.update(saved)
    print("| conv", name, "|", " | ".join(f"{k_} {v_}" for k_, v_ in row.items()), "|", flush=True)
