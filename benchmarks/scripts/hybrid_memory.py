"""Speculative-step memory per request at Qwen3-Next's layer shapes, per commit strategy (issue 17).

    python benchmarks/scripts/hybrid_memory.py [--nodes 8] [--dtype bfloat16] > hybrid-memory.jsonl

Builds transformers' ``Qwen3NextForCausalLM`` with Qwen3-Next-80B-A3B's layer shapes (hidden 2048;
GDN: 16 key heads, 32 value heads, head dims 128, conv width 4; attention: 16 query heads, 2
key/value heads, head dim 256) but only one GDN and one attention layer, a small vocabulary and
small experts (they hold no per-request state), runs it through the qwen plugin on the CPU, and
measures, per request: the committed state (GDN recurrent state and conv window; the attention
layer's KV cache per token), and the records one verify pass of an ``N``-node draft tree keeps
until its commit, for each strategy (``factor``: SpecLA's compact records; ``snapshot``: one state
per node, what vLLM and SGLang keep; ``replay``: the recurrence inputs). Bytes are read off the
tensors the adapter holds (``Record.nbytes_per_sequence``), then scaled to the model's 36 GDN and
12 attention layers. One JSON line per strategy, then a markdown table on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

GDN_LAYERS, ATTN_LAYERS = 36, 12  # Qwen3-Next-80B-A3B: 48 layers, every fourth full attention
SHAPE = dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
             linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
             linear_conv_kernel_dim=4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=8, help="draft nodes N of the verified tree (root excluded)")
    ap.add_argument("--dtype", default="bfloat16", help="activation dtype (the recurrent state stays float32)")
    a = ap.parse_args()
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    from specla import SpecConfig
    from specla.mixers import AttentionMixer
    from specla.registry import get_plugin
    from specla.tree import DraftTree

    torch.manual_seed(0)
    cfg = Qwen3NextConfig(**SHAPE, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                          vocab_size=512, intermediate_size=64, moe_intermediate_size=32,
                          shared_expert_intermediate_size=32, num_experts=2, num_experts_per_tok=1)
    model = Qwen3NextForCausalLM(cfg).to(getattr(torch, a.dtype)).eval()
    model.config._experts_implementation = "eager"
    N = a.nodes
    tree = DraftTree.from_lists([(list(range(1, N + 1)), [-1] + list(range(N - 1)))])  # a chain: same sizes
    rows = []
    for commit in ("factor", "snapshot", "replay"):
        ad = get_plugin("qwen").make_adapter(model, SpecConfig(num_draft_tokens=N, max_depth=N, commit=commit,
                                                               max_new_tokens=64))
        ad.prefill([list(range(1, 33))])
        gdn, attn = ad.mixers
        assert isinstance(attn, AttentionMixer) and not isinstance(gdn, AttentionMixer)
        records = ad.verify(tree).records
        state = sum(t[0].numel() * t.element_size() for t in gdn.state())
        kv_per_token = 2 * attn.HKV * attn.Dh * attn.k_cache.element_size()
        gdn_rec, attn_rec = (r.nbytes_per_sequence() for r in records)
        rows.append(dict(commit=commit, nodes=N, dtype=a.dtype, gdn_state_bytes=state, kv_bytes_per_token=kv_per_token,
                         gdn_record_bytes=gdn_rec, attn_record_bytes=attn_rec,
                         model_state_mib=GDN_LAYERS * state / 2**20,
                         model_kv_kib_per_token=ATTN_LAYERS * kv_per_token / 2**10,
                         model_records_mib=(GDN_LAYERS * gdn_rec + ATTN_LAYERS * attn_rec) / 2**20))
        print(json.dumps(rows[-1]), flush=True)
    print(f"| commit | records of one {N}-node verify, per request (MiB) | x committed GDN state |", file=sys.stderr)
    print("|---|---|---|", file=sys.stderr)
    for r in rows:
        print(f"| {r['commit']} | {r['model_records_mib']:.1f} | {r['model_records_mib'] / r['model_state_mib']:.2f} |",
              file=sys.stderr)
    r = rows[0]
    print(f"committed GDN state {r['model_state_mib']:.1f} MiB per request; KV cache "
          f"{r['model_kv_kib_per_token']:.0f} KiB per token ({GDN_LAYERS} GDN, {ATTN_LAYERS} attention layers)",
          file=sys.stderr)


if __name__ == "__main__":
    main()
