"""Speculative-step memory per request at published hybrid shapes, per commit strategy (issues 17, 18).

    python benchmarks/scripts/hybrid_memory.py [--models all] [--nodes 8] [--dtype bfloat16] > hybrid-memory.jsonl

For each model in :data:`MODELS`, builds its transformers class with the published model's layer
shapes but only one recurrent and one attention layer, a small vocabulary and small MLPs / experts
(they hold no per-request state), runs it through its specla plugin on the CPU, and measures, per
request: the committed state (the recurrent layer's state and conv window; the attention layer's
KV cache per token), and the records one verify pass of an ``N``-node draft chain (a tree of ``N``
nodes gives the same sizes) keeps until its commit, for each strategy (``factor``: SpecLA's
compact records; ``snapshot``: one state per node, what vLLM and SGLang keep; ``replay``: the
recurrence inputs). Bytes are read off the tensors the adapter holds
(``Record.nbytes_per_sequence``), then scaled to the model's recurrent and attention layer
counts. One JSON line per (model, strategy), then a markdown table on stderr. Memory, not speed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hybrid_study import SHAPES  # noqa: E402  (the published shapes the speed study builds in full)
from provenance import add_allow_dirty, print_meta  # noqa: E402

SMALL = dict(vocab_size=512, intermediate_size=64)


def reduced(shape: str, **two_layers) -> tuple[str, str, dict]:
    """``hybrid_study.SHAPES[shape]``'s plugin, config class and kwargs, with :data:`SMALL`'s
    vocabulary and MLP and ``two_layers`` overriding the layer layout (one recurrent and one
    attention layer) and the MoE sizes."""
    plugin, cfg_name, _, kw = SHAPES[shape]
    return plugin, cfg_name, {**kw, **SMALL, **two_layers}


# name: (plugin, transformers config class, config kwargs for one recurrent + one attention layer,
#        recurrent layers, attention layers, where the shapes come from)
MODELS = {
    "qwen3-next-80b": ("qwen", "Qwen3NextConfig", dict(
        hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_experts=2, num_experts_per_tok=1), 36, 12,
        "Qwen3-Next-80B-A3B (transformers' Qwen3NextConfig defaults): GDN 16 key / 32 value heads of 128, "
        "attention 16 / 2 heads of 256"),
    "nemotron-h-8b": (*reduced("nemotron-h-8b", hybrid_override_pattern="M*"), 24, 4,
                      "Nemotron-H-8B: 52 blocks (24 Mamba2, 4 attention, 24 MLP), Mamba2 128 heads of 64, state "
                      "128, 8 groups; attention 32 / 8 heads of 128"),
    "bamba-9b": ("mamba2_hybrid", "BambaConfig", dict(
        hidden_size=4096, num_hidden_layers=2, attn_layer_indices=[1], mamba_n_heads=128, mamba_d_head=64,
        mamba_d_state=128, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2, num_attention_heads=32,
        num_key_value_heads=8), 29, 3,
        "Bamba-9B: 32 layers (attention at 9, 18, 27), Mamba2 128 heads of 64, state 128, 1 group; "
        "attention 32 / 8 heads of 128"),
    "granite-4.0-h-tiny": (*reduced("granite-4.0-h-tiny", num_hidden_layers=2, layer_types=["mamba", "attention"],
                                    num_local_experts=2, num_experts_per_tok=1, shared_intermediate_size=32), 36, 4,
                           "Granite-4.0-H-Tiny (its config.json): 40 layers (attention at 5, 15, 25, 35), Mamba2 48 "
                           "heads of 64, state 128, 1 group; attention 12 / 4 heads of 128"),
    "falcon-h1-1.5b": (*reduced("falcon-h1-1.5b", num_hidden_layers=1), 24, 24,
                       "Falcon-H1-1.5B (its config.json): 24 layers, each with attention (8 / 2 heads of 128) and "
                       "Mamba2 (48 heads of 64, state 256, 1 group) side by side"),
    "kimi-linear-48b": ("kimi_linear", "KimiLinearConfig", dict(
        hidden_size=2304, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
        mlp_layer_types=["dense", "dense"], linear_num_heads=32, linear_head_dim=128, linear_conv_kernel_dim=4,
        num_attention_heads=32, num_key_value_heads=32, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, q_lora_rank=None, moe_intermediate_size=32, num_experts=2,
        num_experts_per_token=1, num_expert_group=1, topk_group=1, pad_token_id=0, bos_token_id=None, eos_token_id=None), 20, 7,
        "Kimi-Linear-48B-A3B: 27 layers (MLA at 4, 8, 12, 16, 20, 24, 27), KDA 32 heads of 128; MLA 32 "
        "heads, latent 512, q/k 128 + 64 rotary, values 128 (specla caches the latent and the rotary key)"),
    "lfm2-1.2b": (*reduced("lfm2-1.2b", num_hidden_layers=2, full_attn_idxs=[1]), 10, 6,
                  "LFM2-1.2B: 16 layers (10 gated short convolutions of width 3, 6 attention), attention 32 / 8 "
                  "heads of 64"),
}


def measure(name: str, nodes: int, dtype: str) -> list[dict]:
    """One row per commit strategy for model ``name`` (see the module docstring)."""
    import transformers

    from specla import SpecConfig
    from specla.mixers import AttentionMixer
    from specla.registry import get_plugin
    from specla.tree import DraftTree

    plugin, cfg_name, kw, n_rec, n_attn, source = MODELS[name]
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_name)(**{**SMALL, **kw})
    model = getattr(transformers, cfg_name.replace("Config", "ForCausalLM"))(cfg).to(getattr(torch, dtype)).eval()
    model.config._experts_implementation = "eager"
    tree = DraftTree.from_lists([(list(range(1, nodes + 1)), [-1] + list(range(nodes - 1)))])
    rows = []
    for commit in ("factor", "snapshot", "replay"):
        ad = get_plugin(plugin).make_adapter(model, SpecConfig(num_draft_tokens=nodes, max_depth=nodes,
                                                               max_new_tokens=64, engine=dict(commit=commit)))
        ad.prefill([list(range(1, 33))])
        (rec_i, rec), (attn_i, attn) = sorted(enumerate(ad.mixers), key=lambda m: isinstance(m[1], AttentionMixer))
        assert isinstance(attn, AttentionMixer) and not isinstance(rec, AttentionMixer), name
        records = ad.verify(tree).records
        state = sum(t[0].numel() * t.element_size() for t in rec.state())
        kv_per_token = (1 if attn.shared_kv else 2) * attn.HKV * attn.Dh * attn.k_cache.element_size()
        rec_bytes, attn_bytes = records[rec_i].nbytes_per_sequence(), records[attn_i].nbytes_per_sequence()
        rows.append(dict(model=name, source=source, commit=commit, nodes=nodes, dtype=dtype,
                         recurrent_layers=n_rec, attention_layers=n_attn, state_bytes=state,
                         kv_bytes_per_token=kv_per_token, recurrent_record_bytes=rec_bytes,
                         attention_record_bytes=attn_bytes, model_state_mib=n_rec * state / 2**20,
                         model_kv_kib_per_token=n_attn * kv_per_token / 2**10,
                         model_records_mib=(n_rec * rec_bytes + n_attn * attn_bytes) / 2**20))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="all", help=f"comma-separated, of {', '.join(MODELS)} (default: all)")
    ap.add_argument("--nodes", type=int, default=8, help="draft nodes N of the verified tree (root excluded)")
    ap.add_argument("--dtype", default="bfloat16", help="activation dtype (the recurrent state stays float32)")
    a = add_allow_dirty(ap).parse_args()
    names = list(MODELS) if a.models == "all" else a.models.split(",")
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        ap.error(f"unknown models {unknown}; choose from {', '.join(MODELS)}")
    print_meta("cpu", a.allow_dirty)  # measured on the CPU
    rows = [r for n in names for r in measure(n, a.nodes, a.dtype)]
    print(f"| model | committed recurrent state (MiB) | KV cache (KiB / token) | records of one {a.nodes}-node verify "
          "(MiB): factor / snapshot / replay | snapshot / factor |", file=sys.stderr)
    print("|---|---|---|---|---|", file=sys.stderr)
    for n in names:
        f, s, r = (x for x in rows if x["model"] == n)
        print(f"| {n} | {f['model_state_mib']:.1f} | {f['model_kv_kib_per_token']:.0f} | {f['model_records_mib']:.1f} / "
              f"{s['model_records_mib']:.1f} / {r['model_records_mib']:.1f} | "
              f"{s['model_records_mib'] / f['model_records_mib']:.0f}x |", file=sys.stderr)


if __name__ == "__main__":
    main()
