"""Speed of hybrid models at published shapes on one GPU, random weights, oracle drafter (issues 17, 18).

    python benchmarks/hybrid_study.py --out DIR [--models qwen3_5-0.8b,bamba-9.8b] [--batches 1,8] [--drafter mtp]
    python benchmarks/hybrid_study.py --out DIR --replot hybrid.json [...]   # the plot again

Each model is a transformers class (FLA's ``GLAForCausalLM`` for GLA) at a published model's layer
shapes (:data:`SHAPES`: Qwen3.5 dense and MoE, Bamba, Nemotron-H, Granite-4.0-H, Falcon-H1, Mamba2,
Kimi-Linear, LFM2, GLA) with random weights in bfloat16, except that the input embedding is scaled
by ``--embed-scale`` and copied into the LM head, as in ``benchmarks/e2e.py``: the greedy next token
is then the input token, which lets the oracle drafter of ``e2e.py`` (:class:`ProfileDrafter`) set
acceptance exactly from a profile (by default the ``small`` target's trained EAGLE drafter on GSM8K,
tree N 15 / depth 6 and chain N 6; ``--profile published:NAME`` and ``--chain-profile
published:NAME`` take a drafter's published acceptance from ``benchmarks/profiles/published.json``,
each the tree's or the chain's own; ``geometric:MEAN`` a geometric profile of ``MEAN`` accepted
drafts per step) while a random drafter drafts a full tree each step, so the drafter's cost is
counted: an EAGLE head of the model's width, or with ``--drafter mtp`` the model's own
checkpoint-style MTP layer (:func:`draft_head`). Acceptance is therefore a replayed profile, not
this model's: these rows are a cost model, not a speed claim for a trained checkpoint.

Rows per model and batch (medians over ``--repeats`` timed runs after a warm-up, prefill excluded):
transformers ``generate`` (greedy, its cache, the model's own kernels: FLA's for Qwen3.5's GDN
layers and for GLA; not run for Mamba2 layers without ``mamba_ssm``, whose PyTorch reference path is
no baseline), specla's graph-captured autoregressive step, SpecLA chain and tree (``factor`` commit,
CUDA graphs). Every speculative row's ``vs_best_ar`` is against the faster of the two plain-decoding
rows; ``exact`` is the fraction of sequences equal to specla's AR output; ``record_mib`` the MiB per
sequence one verify of the tree keeps for its commit, for the ``factor`` and ``snapshot``
strategies.

Writes ``DIR/hybrid.json`` (rows; ``meta``: commit, device, library versions, date and command,
benchmarks/provenance.py, the options as ``args`` and the replayed ``profiles``, ``P(a)`` for
``a = 0..6``), prints one JSON line per row, and plots ``DIR/hybrid.png``: each speculative row's
``vs_best_ar`` against batch (matplotlib, the ``bench`` extra; ``--no-plot`` skips it). With
``--device cpu`` (a check of the script) the steps run the GPU's fixed-shape path unrecorded
(``cuda_graphs="unrecorded"``), which refuses what a CUDA graph could not record.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e import CHAIN, TREE, ProfileDrafter, exact_rate, geometric, measured_profile  # noqa: E402
from provenance import add_allow_dirty, provenance  # noqa: E402

from specla import SpecConfig, SpecDecoder  # noqa: E402
from specla.drafters.eagle import EagleDrafter, EagleHead  # noqa: E402
from specla.drafters.mtp import MTPDrafter  # noqa: E402

# (plugin, config class, model class, config kwargs); a class is a name in transformers or "module:attr"
SHAPES = {
    # Qwen3.5-0.8B's layer shapes: 24 layers, every fourth gated attention (8 query, 2 key/value heads
    # of 256), GDN with 16 key and 16 value heads of 128, MLP 3584, vocabulary 248,320, tied head
    "qwen3_5-0.8b": ("qwen", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(
        vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
        num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
        linear_key_head_dim=128, linear_value_head_dim=128, tie_word_embeddings=True)),
    # Bamba-9.8B (transformers' BambaConfig defaults: 32 layers of width 4096, Mamba2 with 128 heads of
    # 64 and state 128) with attention at layers 9, 18 and 27
    # (its Mamba2 layers add more to the residual stream than GDN's: run it with --embed-scale 2000,
    # or the greedy token is not the input token and bfloat16 near-ties decide the outputs)
    "bamba-9.8b": ("mamba2_hybrid", "BambaConfig", "BambaForCausalLM", dict(attn_layer_indices=[9, 18, 27])),
    # Nemotron-H-8B's block counts and shapes: 52 blocks (24 Mamba2, 4 attention, 24 MLP; the
    # attention blocks spread evenly here, not in the published order), width 4096, Mamba2 128 heads of
    # 64 with state 128 and 8 groups, attention 32 query / 8 key/value heads of 128, MLP 21504
    # (squared ReLU), vocabulary 131,072 (transformers' NemotronHConfig defaults)
    "nemotron-h-8b": ("mamba2_hybrid", "NemotronHConfig", "NemotronHForCausalLM", dict(
        hybrid_override_pattern=("M-" * 6 + "*") * 4)),
    # Granite-4.0-H-Tiny (its config.json): 40 layers of width 1536, attention (12 query, 4 key/value heads
    # of 128, no positions) at 5, 15, 25, 35, Mamba2 elsewhere (48 heads of 64, state 128, 1 group), MoE
    # of 64 experts of 512 with 6 active and a shared expert of 1024, vocabulary 100,352, tied head
    "granite-4.0-h-tiny": ("mamba2_hybrid", "GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
        vocab_size=100352, hidden_size=1536, num_hidden_layers=40,
        layer_types=["attention" if i in (5, 15, 25, 35) else "mamba" for i in range(40)], num_attention_heads=12,
        num_key_value_heads=4, intermediate_size=512, shared_intermediate_size=1024, num_local_experts=64,
        num_experts_per_tok=6, mamba_n_heads=48, mamba_d_head=64, mamba_d_state=128, mamba_n_groups=1,
        mamba_d_conv=4, mamba_expand=2, position_embedding_type="nope", tie_word_embeddings=True)),
    # Falcon-H1-1.5B (its config.json): 24 layers of width 2048, each with attention (8 query, 2 key/value
    # heads of 128) and Mamba2 (48 heads of 64, state 256, 1 group) side by side, MLP 4608, vocabulary 65,537
    "falcon-h1-1.5b": ("mamba2_hybrid", "FalconH1Config", "FalconH1ForCausalLM", dict(
        vocab_size=65537, hidden_size=2048, intermediate_size=4608, num_hidden_layers=24, num_attention_heads=8,
        num_key_value_heads=2, head_dim=128, mamba_d_ssm=3072, mamba_n_heads=48, mamba_d_head=64,
        mamba_d_state=256, mamba_n_groups=1, mamba_d_conv=4)),
    # transformers' Mamba2ForCausalLM at Mamba2-1.3B's shape: 48 layers of width 2048, 64 heads of 64,
    # state 128, 1 group, vocabulary 50,288, tied head (no attention: the pure-Mamba2 row)
    "mamba2-1.3b": ("mamba2_hybrid", "Mamba2Config", "Mamba2ForCausalLM", dict(
        vocab_size=50288, hidden_size=2048, num_hidden_layers=48, num_heads=64, head_dim=64, state_size=128,
        n_groups=1, expand=2, tie_word_embeddings=True)),
    # Kimi-Linear-48B-A3B's layer shapes with 32 routed experts instead of 256 (the same 8 active of
    # 1024 and one shared expert per token, so the same step compute; 7x fewer weights to build):
    # 27 layers of width 2304, MLA (32 heads, latent 512, q/k 128 + 64 rotary, values 128) at layers
    # 4, 8, 12, 16, 20, 24, 27 (1-based), KDA (32 heads of 128, conv 4) elsewhere, the first layer's
    # MLP dense (9216), vocabulary 163,840
    "kimi-linear-48b-32e": ("kimi_linear", "KimiLinearConfig", "KimiLinearForCausalLM", dict(
        vocab_size=163840, hidden_size=2304, num_hidden_layers=27, intermediate_size=9216,
        layer_types=["full_attention" if i + 1 in (4, 8, 12, 16, 20, 24, 27) else "linear_attention"
                     for i in range(27)],
        mlp_layer_types=["dense"] + ["sparse"] * 26, linear_num_heads=32, linear_head_dim=128,
        linear_conv_kernel_dim=4, num_attention_heads=32, num_key_value_heads=32, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, q_lora_rank=None, moe_intermediate_size=1024,
        num_local_experts=32, num_experts_per_tok=8, n_shared_experts=1, pad_token_id=0, bos_token_id=None)),
    # LFM2-1.2B: 16 layers of width 2048, attention (32 query, 8 key/value heads of 64) at 2, 5, 8, 10,
    # 12 and 14, gated short convolutions of width 3 elsewhere, feed-forward 8192 (12288 auto-adjusted),
    # vocabulary 65,536, tied head
    "lfm2-1.2b": ("lfm2", "Lfm2Config", "Lfm2ForCausalLM", dict(
        vocab_size=65536, hidden_size=2048, intermediate_size=12288, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, conv_L_cache=3, full_attn_idxs=[2, 5, 8, 10, 12, 14], tie_word_embeddings=True)),
    # Qwen3.5-35B-A3B's layer shapes (transformers' Qwen3_5MoeTextConfig defaults, documented as that
    # checkpoint's, and THUDM/slime scripts/models/qwen3.5-35B-A3B.sh agree): width 2048, every fourth
    # layer gated attention (16 query, 2 key/value heads of 256, rotary on a quarter), GDN with 16 key
    # and 32 value heads of 128 (conv 4), MoE in every layer (256 experts of 512, 8 active, plus a gated
    # shared expert of 512), vocabulary 248,320, untied head. Cut to 20 of its 40 layers (5 attention,
    # 15 GDN): the full stack's 34.7B parameters take 65 GiB in bfloat16, which with its recurrent
    # state at batch 256 (30 GDN layers x 2 MiB x 256 = 15 GiB) does not fit one 80 GB GPU; 20 layers
    # hold 17.8B (33 GiB). The experts run grouped_mm, which reads each expert's weights once:
    # batched_mm gathers a 6 MiB copy of them per (token, expert) pair, 192 GiB per layer for a
    # 16-node tree at batch 256
    "qwen3_5-35b-a3b-20l": ("qwen", "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(
        vocab_size=248320, hidden_size=2048, num_hidden_layers=20, num_attention_heads=16, num_key_value_heads=2,
        head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, num_experts=256, num_experts_per_tok=8, tie_word_embeddings=False,
        experts_implementation="grouped_mm")),
    # FLA's GLA-1.3B (fla-hub/gla-1.3B-100B, FLA's GLAConfig defaults): 24 layers of width 2048, GLA with 4
    # heads of key 256 / value 512 (expand_k 0.5, expand_v 1), no short conv, output gate, SwiGLU MLP 5632
    # (hidden_ratio 4), vocabulary 32,000, untied head (no attention: the pure-GLA row)
    "gla-1.3b": ("gla", "fla.models:GLAConfig", "fla.models:GLAForCausalLM", dict(
        vocab_size=32000, hidden_size=2048, num_hidden_layers=24, num_heads=4, expand_k=0.5, expand_v=1,
        hidden_ratio=4, use_short_conv=False, use_output_gate=True, attn_mode="chunk", tie_word_embeddings=False)),
    # tiny shapes for a CPU check of the script itself
    "qwen3_5-tiny": ("qwen", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=16)),
    "qwen3_5-moe-tiny": ("qwen", "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(
        vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, experts_implementation="grouped_mm")),
    "bamba-tiny": ("mamba2_hybrid", "BambaConfig", "BambaForCausalLM", dict(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_state=16, mamba_n_groups=1)),
    "nemotron-h-tiny": ("mamba2_hybrid", "NemotronHConfig", "NemotronHForCausalLM", dict(
        vocab_size=512, hidden_size=64, intermediate_size=96, hybrid_override_pattern="M-*-", num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, n_groups=1)),
    "granite-4.0-h-tiny-check": ("mamba2_hybrid", "GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
        vocab_size=512, hidden_size=64, num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"],
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=32, shared_intermediate_size=48,
        num_local_experts=4, num_experts_per_tok=2, mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16,
        mamba_n_groups=1, position_embedding_type="nope")),
    "falcon-h1-tiny": ("mamba2_hybrid", "FalconH1Config", "FalconH1ForCausalLM", dict(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16,
        mamba_n_groups=1)),
    "lfm2-tiny": ("lfm2", "Lfm2Config", "Lfm2ForCausalLM", dict(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, full_attn_idxs=[1])),
    "gla-tiny": ("gla", "fla.models:GLAConfig", "fla.models:GLAForCausalLM", dict(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_heads=2, expand_k=0.5,
        expand_v=1, use_short_conv=False, use_output_gate=True, attn_mode="chunk", tie_word_embeddings=False)),
}


def _class(name: str) -> type:
    """A class :data:`SHAPES` names: ``module:attr`` (``fla.models:GLAConfig``), or a bare name of transformers'."""
    module, _, attr = name.rpartition(":")
    return getattr(importlib.import_module(module or "transformers"), attr)


def build(name: str, embed_scale: float, device: str, dtype: torch.dtype):
    """The model of ``SHAPES[name]`` with the embedding trick of the module docstring."""
    plugin, cfg_cls, model_cls, kw = SHAPES[name]
    torch.manual_seed(0)
    cfg = _class(cfg_cls)(**{"eos_token_id": None, **kw})
    with torch.device(device):  # built in ``dtype``: a float32 copy of the largest shapes would not fit
        model = _class(model_cls)._from_config(cfg, dtype=dtype).eval()
    # MoE experts a CUDA graph records (specla.mixers.experts_graph_problem); a shape may name grouped_mm
    model.config._experts_implementation = kw.get("experts_implementation", "batched_mm")
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb.mul_(embed_scale)
        if model.lm_head.weight.data_ptr() != emb.data_ptr():
            model.lm_head.weight.copy_(emb)
    return plugin, model


def draft_head(kind: str, model) -> tuple[type, torch.nn.Module]:
    """The drafter class and the random head whose cost every speculative step pays (its drafts
    are discarded by :class:`ProfileDrafter`): ``eagle``, an EAGLE head of the model's width;
    ``mtp``, the checkpoint-style MTP layer of the qwen plugin (:class:`specla_qwen.mtp.QwenMTPHead`:
    ``fc`` over the pair, one decoder layer of the model's own full-attention class, MoE where the
    model's layers are, and the norms), on the model's device, initialised as transformers
    initialises the model (the head's own classes leave the experts' weights unset)."""
    if kind == "eagle":
        return EagleDrafter, EagleHead(model.get_input_embeddings().weight.shape[1])
    from specla_qwen.mtp import QwenMTPHead

    with torch.device(model.lm_head.weight.device):
        head = QwenMTPHead(model, None)
    head.apply(model._init_weights)
    return MTPDrafter, head


def plot(rows: list[dict], meta: dict, path: Path) -> None:
    """Speedup over the fastest plain decoding (``vs_best_ar``) against batch, a line per model and
    kind (chain solid, tree dashed), the 1.0x and 2.0x lines drawn: a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for model in dict.fromkeys(r["model"] for r in rows):
        for kind, style in (("chain", "-o"), ("tree", "--s")):
            pts = sorted((r["B"], r["vs_best_ar"]) for r in rows if r["model"] == model and r["row"] == f"SpecLA {kind}")
            if pts:
                ax.plot(*zip(*pts), style, label=f"{model}, {kind}")
    for y in (1.0, 2.0):
        ax.axhline(y, color="gray", lw=0.8, ls=":" if y == 2.0 else "-")
    ax.set_xscale("log", base=2)
    batches = sorted({r["B"] for r in rows})
    ax.set_xticks(batches, [str(B) for B in batches])
    drafter = meta.get("args", {}).get("drafter", "eagle")  # reports from before --drafter drafted with EAGLE
    ax.set(xlabel="batch", ylabel="tokens/s over the fastest plain decoding", ylim=(0, None),
           title=f"cost model: random weights, {drafter} drafter's cost, replayed acceptance\n"
                 f"{meta.get('device') or meta.get('gpu')}, commit {meta['commit']}")  # older reports: gpu
    ax.title.set_fontsize(8)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def timed(dec: SpecDecoder, prompts: list[list[int]], repeats: int) -> dict:
    """Warm-up (records the graphs), then ``repeats`` runs: median decode time (prefill
    excluded), tokens/s, ms per step, accepted drafts per step, the outputs."""
    dec.generate(prompts)
    runs = []
    for _ in range(repeats):
        r = dec.generate(prompts)
        runs.append((r.stats.wall_s - r.stats.prefill_s, r))
    s = statistics.median(t for t, _ in runs)
    r = runs[0][1]
    return dict(tokens_per_s=r.stats.generated_tokens / s, ms_per_step=s / r.stats.steps * 1e3,
                accepted_per_step=r.stats.mean_accepted_tokens, outputs=r.outputs)


def hf_generate(model, prompts: list[list[int]], n: int, repeats: int) -> dict:
    """transformers ``generate``, greedy with its cache, ``n`` new tokens: tokens/s and outputs."""
    ids = torch.tensor(prompts, device=model.lm_head.weight.device)
    kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, use_cache=True, pad_token_id=0)
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    with torch.no_grad():
        out = model.generate(ids, **kw)
        times = []
        for _ in range(repeats):
            sync()
            t = time.perf_counter()
            model.generate(ids, **kw)
            sync()
            times.append(time.perf_counter() - t)
    return dict(tokens_per_s=len(prompts) * n / statistics.median(times), outputs=out[:, ids.shape[1]:].tolist())


def record_mib(dec: SpecDecoder) -> float:
    """MiB per sequence one eager verify of the drafter's full tree keeps for its commit."""
    ad, cfg = dec.adapter, dec.config
    ad.prefill([[1, 2]])
    dec.drafter.reset([[1, 2]])
    out = ad.verify(dec.drafter.propose_on_device(ad.roots, cfg))
    return sum(r.nbytes_per_sequence() for r in out.records) / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="qwen3_5-0.8b,bamba-9.8b")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--tokens", type=int, default=96, help="new tokens per sequence (specla rows)")
    ap.add_argument("--hf-tokens", type=int, default=32, help="new tokens per transformers generate run")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--embed-scale", type=float, default=32.0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--profile", default="benchmarks/results/2026-11-30/run4/acceptance-gsm8k.json:gsm8k/eagle-tree",
                    help="the tree's profile: FILE.json:RUN of acceptance.py, published:NAME of "
                    "benchmarks/profiles/published.json, or geometric:MEAN (e2e.measured_profile)")
    ap.add_argument("--chain-profile", default="benchmarks/results/2026-11-30/run4/acceptance-gsm8k.json"
                    ":gsm8k/eagle-chain", help="the chain's profile, as --profile")
    ap.add_argument("--drafter", choices=("eagle", "mtp"), default="eagle",
                    help="whose cost each step pays (draft_head): a random EAGLE head, or the model's own MTP "
                    "layer with random weights (qwen models)")
    ap.add_argument("--no-plot", action="store_true", help="write hybrid.json only, not hybrid.png")
    ap.add_argument("--replot", nargs="+", metavar="JSON", help="write OUT/hybrid.png of earlier hybrid.json files "
                    "(rows merged, the first one's meta in the title); nothing is measured")
    a = add_allow_dirty(ap).parse_args()
    if not a.no_plot and importlib.util.find_spec("matplotlib") is None:
        ap.error("the plot needs matplotlib: pip install 'specla[bench]' (or pass --no-plot)")
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if a.replot:
        reports = [json.loads(Path(f).read_text()) for f in a.replot]
        plot([r for d in reports for r in d["rows"]], reports[0]["meta"], out_dir / "hybrid.png")
        return
    unknown = [m for m in a.models.split(",") if m not in SHAPES]
    if unknown:
        ap.error(f"--models: unknown {unknown}; known: {', '.join(SHAPES)}")
    no_mtp = [m for m in a.models.split(",") if SHAPES[m][0] != "qwen"]
    if a.drafter == "mtp" and no_mtp:
        ap.error(f"--drafter mtp builds the qwen plugin's MTP layer; {no_mtp} are not qwen models")
    profiles = {"tree": measured_profile(a.profile), "chain": measured_profile(a.chain_profile)}
    meta = dict(provenance(a.device, a.allow_dirty), args=dict(vars(a)), profiles=profiles)
    graphs = "on" if a.device == "cuda" else "unrecorded"
    rows = []

    def add(**row):
        row.pop("outputs", None)
        rows.append(row)
        (out_dir / "hybrid.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)

    for name in a.models.split(","):
        plugin, model = build(name, a.embed_scale, a.device, torch.bfloat16)
        params = sum(p.numel() for p in model.parameters())
        drafter_cls, head = draft_head(a.drafter, model)
        g = torch.Generator().manual_seed(0)
        V = model.get_input_embeddings().weight.shape[0]
        for B in (int(b) for b in a.batches.split(",")):
            prompts = torch.randint(0, V, (B, a.prompt_len), generator=g).tolist()

            def decoder(tree: dict, commit: str = "factor", profile=None):
                cfg = SpecConfig(device=a.device, dtype="bfloat16", stop_at_eos=False, max_new_tokens=a.tokens,
                                 engine=dict(commit=commit, cuda_graphs=graphs, budget_policy="fixed"), **tree)
                draft = drafter_cls(head) if tree["num_draft_tokens"] else None
                return SpecDecoder(model, plugin, drafter=ProfileDrafter(profile or geometric(0.0, 6), draft),
                                   config=cfg)

            base = dict(model=name, params=params, B=B)
            ar = timed(decoder(dict(num_draft_tokens=0)), prompts, a.repeats)
            # transformers generate with the model's own kernels only: on a CPU (a check of this
            # script) it would pick FLA's GPU kernels, and without mamba_ssm its Mamba2 layers run
            # a PyTorch reference path no one serves with
            kernels = plugin != "mamba2_hybrid" or importlib.util.find_spec("mamba_ssm") is not None
            hf = hf_generate(model, prompts, a.hf_tokens, a.repeats) if a.device == "cuda" and kernels else None
            best = max(ar["tokens_per_s"], hf["tokens_per_s"] if hf else 0.0)
            if hf:
                add(**base, row="transformers generate", tokens_per_s=hf["tokens_per_s"],
                    vs_best_ar=hf["tokens_per_s"] / best, exact=exact_rate(hf["outputs"], ar["outputs"]))
            add(**base, row="specla AR (graph)", **ar, vs_best_ar=ar["tokens_per_s"] / best, exact=1.0)
            for kind, tree in (("chain", CHAIN), ("tree", TREE)):
                dec = decoder(tree, profile=profiles[kind])
                r, mib = timed(dec, prompts, a.repeats), record_mib(dec) if B == 1 else None
                dec = None  # one decoder's state and graphs on the device at a time: large shapes at batch 256
                snap = record_mib(decoder(tree, "snapshot", profiles[kind])) if B == 1 else None
                add(**base, row=f"SpecLA {kind}", **r, vs_best_ar=r["tokens_per_s"] / best,
                    exact=exact_rate(r["outputs"], ar["outputs"]), record_mib=mib, snapshot_record_mib=snap)
        model = head = None
        if a.device == "cuda":
            torch.cuda.empty_cache()
    if not a.no_plot:
        plot(rows, meta, out_dir / "hybrid.png")


if __name__ == "__main__":
    main()
