"""The GDN tree-verify and tree-conv kernels on the inputs the engine gives them (BENCHMARKS.md
section 5, "The tree kernels on the engine's own inputs").

    python benchmarks/scripts/engine_kernels_probe.py [--shapes small:32,gdn-1.3b:64] [--tiles] > probe.md

For each ``shape:batch``: a randomly initialised GDN model of that shape (a ``train_target.py``
preset, or GDN-1.3B's as ``e2e.py``) in bfloat16 with a random attention EAGLE head, prompts of 69
random tokens, the tree row (N 15, depth 6, top-k 4), CUDA graphs off (the kernels' inputs are the
same; a recorded step's calls could not be copied). One ``generate`` call keeps copies of the first
tree verify's inputs whose pending commit has a path in every sequence (it raises
``RuntimeError`` when none has; the report names the path lengths) and the first 16-node
tree conv's, as the GDN mixer passes them (q and k L2-normalised in float32, v a bf16 slice of
the projection, the conv input a slice of a wider projection). Then, at the batch and at batch 1
(its first row):

- ``tree_verify`` with the pending commit, for each pair of precisions where the activations are
  not float32 (the products', ``TUNING["tree"]["dot"]``, and the commit's,
  ``TUNING["tree"]["commit"]``: ``ieee``, ``tf32x3``, ``tf32``) and each form of the prepare
  (``TUNING["tree"]["prepare"]``: ``separate``, ``fused``): µs per launch
  (``triton.testing.do_bench_cudagraph``);
- each pair's error on the first four sequences, with their pending commit, against the float64
  twins (``naive_tree_gdn`` from the commit's closed form, ``gdn_commit_factor``, in float64):
  the largest error of ``o``, ``Delta`` and the committed state over their largest value, and the
  largest error of ``G``;
- with ``--tiles``: the default precisions at the batch, each form of the prepare, over V-tile
  widths 32 and 64, K blocks of 32, 64 and 128, 4 and 8 warps, 2 and 3 pipeline stages
  (``TUNING["tree"]``: ``tiles``, ``num_warps``, ``num_stages``);
- ``tree_conv``: one node per program against tiles of 4, 8 and 16 nodes
  (``specla.ops.conv_triton.TUNING``), on the 16-node pass and on one-token passes of random
  inputs; µs per launch, each checked bit-identical to one node per program.

``TUNING`` is restored afterwards. One CUDA GPU; FLA installed. ``--device cpu`` checks the
script's logic on the ``tiny`` shape (Triton's interpreter, ``TRITON_INTERPRET=1``; no timings;
``--shapes`` is refused there, and every precision computes alike in the interpreter).
"""
import argparse
import contextlib
import itertools
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "targets"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from e2e import GDN13B_SHAPE  # noqa: E402
from provenance import add_allow_dirty, print_meta  # noqa: E402
from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM  # noqa: E402
from train_target import PRESETS  # noqa: E402

import specla.ops.conv_triton as conv_kernels  # noqa: E402
from specla import SpecDecoder  # noqa: E402
from specla.drafters.eagle import EagleDrafter, EagleHead  # noqa: E402
from specla.ops.conv import conv_ancestors  # noqa: E402
from specla.records import LayerCommit  # noqa: E402
import specla.mixers.gdn.verify as gdn_verify  # noqa: E402  (the mixer looks its kernels up there at each call)
import specla.mixers.gdn.verify as vk  # noqa: E402
from specla.mixers.gdn.naive import naive_tree_gdn  # noqa: E402
from specla.mixers.gdn.reference import gdn_commit_factor  # noqa: E402

PRECISIONS = (("ieee", "ieee"), ("tf32x3", "ieee"), ("tf32x3", "tf32x3"), ("tf32", "ieee"), ("tf32", "tf32"))
FORMS = ("separate", "fused")
CONV = {"one node": dict(node_programs=2**62), **{f"{r}-node tiles": dict(node_programs=0, rows=r) for r in (4, 8, 16)}}
CUDA = True  # set by --device


def us(fn) -> float:
    """Device µs per launch (``do_bench_cudagraph``); on the CPU one eager run and 0."""
    if not CUDA:
        fn()
        return 0.0
    return round(triton.testing.do_bench_cudagraph(fn, rep=30) * 1e3, 1)


@contextlib.contextmanager
def tuned(table: dict, **kw):
    """``table`` updated with ``kw`` inside the block, restored after it."""
    saved = {k: table[k] for k in kw}
    table.update(kw)
    try:
        yield
    finally:
        table.update(saved)


def captured_inputs(shape: dict, B: int, device: str) -> dict:
    """The first tree verify's inputs with a pending commit and the first 16-node tree conv's, from
    one ``generate`` call of a random model of ``shape`` at batch ``B``."""
    cap = {}
    verify, conv = gdn_verify.tree_verify, conv_kernels.tree_conv

    def keep_verify(q, k, v, g, beta, state, mask, scale, pending=None, out=None):
        # copies: the state and the pending commit's buffers are the engine's, rewritten by later
        # steps; the first call whose every sequence commits a path (a prefill's pass commits none)
        if pending is not None and "verify" not in cap and bool((pending.path_len > 0).all()):
            kept = tuple(x.clone() for x in (q, k, v, g, beta, state, mask))
            cap["verify"] = kept + (scale, mapped(pending, torch.clone))
        return verify(q, k, v, g, beta, state, mask, scale, pending=pending, out=out)

    def keep_conv(x, window, weight, bias, anc, out=None):
        # the window is the engine's, rewritten in place by later commits: a copy; x (a slice of a
        # wider projection, whose layout is what is timed) and anc are this pass's own
        if x.shape[1] == 16 and "conv" not in cap:
            cap["conv"] = (x, window.clone(), weight, bias, anc)
        return conv(x, window, weight, bias, anc, out=out)

    torch.manual_seed(0)
    dtype = torch.bfloat16 if CUDA else torch.float32
    model = GatedDeltaNetForCausalLM(GatedDeltaNetConfig(vocab_size=32000, **shape)).to(device, dtype).eval()
    prompts = [torch.randint(0, 32000, (69,)).tolist() for _ in range(B)]
    dec = SpecDecoder(model, "gdn", drafter=EagleDrafter(EagleHead(model.config.hidden_size)), config=dict(
        dtype=str(dtype).removeprefix("torch."), device=device, max_new_tokens=4, stop_at_eos=False,
        engine=dict(cuda_graphs="off", kernels="triton", budget_policy="fixed"), num_draft_tokens=15,
        max_depth=6, top_k=4))
    gdn_verify.tree_verify, conv_kernels.tree_conv = keep_verify, keep_conv
    try:
        dec.generate(prompts)
    finally:
        gdn_verify.tree_verify, conv_kernels.tree_conv = verify, conv
    if "verify" not in cap:
        raise RuntimeError("no tree verify committed a path in every sequence: nothing to probe")
    return cap


def mapped(pending: LayerCommit, fn) -> LayerCommit:
    """A pending commit with ``fn`` applied to each of its tensors."""
    rec = pending.record
    fields = {f: None if getattr(rec, f) is None else fn(getattr(rec, f)) for f in ("k", "delta", "G", "conv_x")}
    return LayerCommit(type(rec)(**fields), fn(pending.path), fn(pending.path_len))


def first_rows(pending: LayerCommit, n: int) -> LayerCommit:
    """A pending commit's first ``n`` sequences."""
    return mapped(pending, lambda t: t[:n])


def parents_of(mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` parents from an inclusive-ancestor mask (topological order: a node's parent is
    its ancestor with the largest index)."""
    B, T, _ = mask.shape
    strict = mask & ~torch.eye(T, dtype=torch.bool, device=mask.device)
    idx = torch.arange(T, device=mask.device).expand(B, T, T)
    return torch.where(strict, idx, -1).amax(-1)


def verify_rows(name: str, cap: dict, B: int) -> None:
    """Times of every prepare form and precision at ``B`` and 1."""
    q, k, v, g, beta, S, mask, scale, pending = cap["verify"]
    for n in (B, 1):
        args = [x[:n] for x in (q, k, v, g, beta)] + [S[:n].clone(), mask[:n]]  # the timed calls commit
        pend = first_rows(pending, n)
        cells = []
        for form in FORMS:
            for dot, commit in PRECISIONS:
                with tuned(vk.TUNING["tree"], dot=dot, commit=commit, prepare=form):
                    cells.append(us(lambda: vk.tree_verify(*args, scale, pending=pend)))
        print(f"| {name} | {n} | {q.shape[1]} | " + " | ".join(str(c) for c in cells) + " |", flush=True)


def error_rows(name: str, cap: dict) -> None:
    """Each pair of precisions' error on the first four sequences, with their pending commit,
    against the float64 twins."""
    q, k, v, g, beta, S, mask, scale, pending = cap["verify"]
    n = min(4, q.shape[0])
    args, pend = [x[:n] for x in (q, k, v, g, beta)], first_rows(pending, n)
    rec = pend.record
    ref_S = gdn_commit_factor(*(x.double() for x in (S[:n], rec.k, rec.delta, rec.G)), pend.path, pend.path_len)
    ro, rd, rG, _ = naive_tree_gdn(*(x.double() for x in args), ref_S, parents_of(mask[:n]), scale)
    rel = lambda got, ref: float((got.double() - ref).abs().max() / ref.abs().max())  # noqa: E731
    for dot, commit in PRECISIONS:
        state = S[:n].clone()
        with tuned(vk.TUNING["tree"], dot=dot, commit=commit):
            o, d, G = vk.tree_verify(*args, state, mask[:n], scale, pending=pend)
        err = [rel(o, ro), rel(d, rd), float((G.double() - rG).abs().max()), rel(state, ref_S)]
        print(f"| {name} | {dot} | {commit} | " + " | ".join(f"{e:.1e}" for e in err) + " |", flush=True)


def tile_rows(name: str, cap: dict, B: int) -> None:
    """The default precisions at ``B`` over the tree kernel's launch parameters, each prepare form."""
    q, k, v, g, beta, S, mask, scale, pending = cap["verify"]
    state = S.clone()  # the timed calls commit
    for form in FORMS:
        for bv, bkc, warps, stages in itertools.product((32, 64), (32, 64, 128), (4, 8), (2, 3)):
            with tuned(vk.TUNING["tree"], prepare=form, tiles={form: (bv, bkc)}, num_warps=warps, num_stages=stages):
                t = us(lambda: vk.tree_verify(q, k, v, g, beta, state, mask, scale, pending=pending))
            print(f"| {name} | {B} | {form} | {bv} | {bkc} | {warps} | {stages} | {t} |", flush=True)


def conv_rows(name: str, cap: dict, B: int) -> None:
    """``tree_conv`` per program layout on the captured 16-node pass and on one-token passes."""
    x, window, weight, bias, _ = cap["conv"]
    D, W, dev = x.shape[-1], window.shape[1], x.device
    cases = {}
    for n in (B, 1):
        cases[f"16-node trees, batch {n}"] = tuple(t[:n] for t in (x, window)) + (weight, bias, cap["conv"][4][:n])
        wide = torch.randn(n, 1, D + 512, device=dev, dtype=x.dtype)
        cases[f"one token, batch {n}"] = (wide[..., :D], torch.randn(n, W, D, device=dev, dtype=x.dtype), weight, bias,
                                          conv_ancestors(torch.full((n, 1), -1, device=dev), weight.shape[1]))
    for case, args in cases.items():
        with tuned(conv_kernels.TUNING, **CONV["one node"]):
            ref = conv_kernels.tree_conv(*args)
        cells = []
        for kw in CONV.values():
            with tuned(conv_kernels.TUNING, **kw):
                cells.append(us(lambda: conv_kernels.tree_conv(*args)))
                if not torch.equal(conv_kernels.tree_conv(*args), ref):
                    raise AssertionError(f"tree_conv with {kw} differs from one node per program ({case})")
        print(f"| {name} | {case} | " + " | ".join(str(c) for c in cells) + " |", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="small:32,gdn-1.3b:64", help="shape:batch, comma-separated")
    p.add_argument("--device", default="cuda", help="cpu: check the script's logic on the tiny shape")
    p.add_argument("--tiles", action="store_true", help="also sweep the tree kernel's launch parameters")
    a = add_allow_dirty(p).parse_args()
    global CUDA
    CUDA = torch.device(a.device).type == "cuda"
    if not CUDA and a.shapes != p.get_default("shapes"):
        p.error("--shapes needs a CUDA device (the CPU check runs the tiny shape)")
    print_meta(a.device, a.allow_dirty)
    shapes = [s.split(":") for s in (a.shapes if CUDA else "tiny:2").split(",")]
    caps = {}
    for name, B in shapes:
        shape = dict(num_hidden_layers=24, **GDN13B_SHAPE) if name == "gdn-1.3b" else PRESETS[name]["model"]
        caps[name] = (captured_inputs(shape, int(B), a.device), int(B))
        q, v = caps[name][0]["verify"][0], caps[name][0]["verify"][2]
        plen = caps[name][0]["verify"][8].path_len.tolist()
        print(f"<!-- {name}: q {q.dtype} {list(q.shape)}, v {v.dtype} {list(v.shape)}, "
              f"pending path lengths of the first 8 sequences {plen[:8]} -->", flush=True)
    print("| shape | batch | nodes | " + " | ".join(f"{f}, {d}/{c}" for f in FORMS for d, c in PRECISIONS) + " |")
    print("|---|---|---|" + "---|" * (len(FORMS) * len(PRECISIONS)))
    for name, (cap, B) in caps.items():
        verify_rows(name, cap, B)
    print("\n| shape | products | commit | o | Delta | G | committed state |")
    print("|---|---|---|---|---|---|---|")
    for name, (cap, B) in caps.items():
        error_rows(name, cap)
    if a.tiles:
        print("\n| shape | batch | prepare | BV | BKC | warps | stages | us |")
        print("|---|---|---|---|---|---|---|---|")
        for name, (cap, B) in caps.items():
            tile_rows(name, cap, B)
    print("\n| shape | pass | " + " | ".join(CONV) + " |")
    print("|---|---|" + "---|" * len(CONV))
    for name, (cap, B) in caps.items():
        conv_rows(name, cap, B)


if __name__ == "__main__":
    main()
