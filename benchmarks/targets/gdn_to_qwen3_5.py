"""Rewrite a trained FLA ``GatedDeltaNetForCausalLM`` checkpoint as transformers'
``Qwen3_5ForCausalLM`` with every layer a linear-attention (Gated DeltaNet) layer: the same
function in a class that transformers ships, so that a model trained with FLA runs where FLA is
not installed. This is how the qwen plugin's demo target was made from the trained ``tiny`` GDN
target:

    python benchmarks/targets/gdn_to_qwen3_5.py plugins/fla/assets/tiny plugins/qwen/assets/tiny

The two classes compute one function (FLA's ``GatedDeltaNet`` layer with ``use_gate``, short
convolutions and SiLU, against transformers' ``Qwen3_5GatedDeltaNet``):

- q, k and v projections and their depthwise convolutions are concatenated in that order
  (``in_proj_qkv``, ``conv1d``); ``g_proj`` is ``in_proj_z``, ``a_proj``/``b_proj`` are
  ``in_proj_a``/``in_proj_b``, ``o_proj`` is ``out_proj``, ``o_norm`` is ``norm`` (both gated
  RMSNorms compute ``norm(o) * w * silu(z)``);
- transformers' Qwen3.5 RMSNorm scales by ``1 + w`` where FLA's scales by ``w``, so the block and
  final norms store ``w - 1``: exact in the checkpoint's dtype for every weight here (checked);
- the MLP (SwiGLU), the embeddings tied to the LM head, ``A_log`` and ``dt_bias`` carry over.

The test ``tests/plugins/test_qwen.py::test_the_demo_target_is_the_fla_target_in_qwen3_5_form`` checks
that both models give the same logits.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

# files copied as they are: the tokenizer, and the training record of the weights
COPIED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "training.json")


def qwen3_5_config(fla: dict) -> dict:
    """The ``Qwen3_5TextConfig`` fields of an FLA ``gated_deltanet`` config (no attention layers).

    Raises:
        ValueError: an FLA option the Qwen3.5 layer does not compute (no gate, no short conv,
            another activation, FLA attention layers, grouped value heads, negative eigenvalues).
    """
    unsupported = {k: fla.get(k) for k, want in (("use_gate", True), ("use_short_conv", True), ("attn", None),
                                                   ("hidden_act", "swish"), ("allow_neg_eigval", False),
                                                   ("num_v_heads", None), ("use_l2warp", False))
                   if fla.get(k) != want}
    if unsupported:
        raise ValueError(f"this FLA GatedDeltaNet config has options Qwen3.5's layer does not compute: {unsupported}")
    hidden, heads, head_dim = fla["hidden_size"], fla["num_heads"], fla["head_dim"]
    intermediate = fla["intermediate_size"]
    if intermediate is None:  # FLA's GatedMLP: 2/3 of hidden_ratio x hidden, rounded up to 256
        intermediate = int(hidden * fla["hidden_ratio"] * 2 / 3)
        intermediate = 256 * ((intermediate + 255) // 256)
    return {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "vocab_size": fla["vocab_size"],
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": fla["num_hidden_layers"],
        "layer_types": ["linear_attention"] * fla["num_hidden_layers"],
        "linear_conv_kernel_dim": fla["conv_size"],
        "linear_key_head_dim": head_dim,
        "linear_value_head_dim": int(head_dim * fla["expand_v"]),
        "linear_num_key_heads": heads,
        "linear_num_value_heads": heads,
        # the attention fields are unused (no attention layer) but must be valid
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": fla["norm_eps"],
        "max_position_embeddings": fla["max_position_embeddings"],
        "tie_word_embeddings": fla["tie_word_embeddings"],
        "bos_token_id": fla["bos_token_id"],
        "eos_token_id": fla["eos_token_id"],
        "pad_token_id": fla["pad_token_id"],
        "dtype": fla.get("dtype", "bfloat16"),
    }


def qwen3_5_weights(fla: dict[str, torch.Tensor], layers: int) -> dict[str, torch.Tensor]:
    """The ``Qwen3_5ForCausalLM`` state dict of an FLA ``GatedDeltaNetForCausalLM`` state dict.

    Raises:
        ValueError: a norm weight whose ``w - 1`` is not exact in its dtype; FLA weights left
            unmapped (the message names them).
    """
    left = dict(fla)

    def take(name: str) -> torch.Tensor:
        return left.pop(name)

    def offset_norm(name: str) -> torch.Tensor:  # FLA scales by w, Qwen3.5 by 1 + w
        w = take(name)
        shifted = (w.double() - 1).to(w.dtype)
        if not torch.equal(shifted.double() + 1, w.double()):
            raise ValueError(f"{name}: w - 1 is not exact in {w.dtype}")
        return shifted

    out = {"model.embed_tokens.weight": take("model.embeddings.weight"),
           "model.norm.weight": offset_norm("model.norm.weight")}
    left.pop("lm_head.weight", None)  # tied to the embeddings
    for i in range(layers):
        src, dst = f"model.layers.{i}.", f"model.layers.{i}."
        a = src + "attn."
        out |= {
            dst + "input_layernorm.weight": offset_norm(src + "attn_norm.weight"),
            dst + "post_attention_layernorm.weight": offset_norm(src + "mlp_norm.weight"),
            dst + "linear_attn.in_proj_qkv.weight": torch.cat([take(a + f"{x}_proj.weight") for x in "qkv"]),
            dst + "linear_attn.conv1d.weight": torch.cat([take(a + f"{x}_conv1d.weight") for x in "qkv"]),
            dst + "linear_attn.in_proj_z.weight": take(a + "g_proj.weight"),
            dst + "linear_attn.in_proj_a.weight": take(a + "a_proj.weight"),
            dst + "linear_attn.in_proj_b.weight": take(a + "b_proj.weight"),
            dst + "linear_attn.A_log": take(a + "A_log"),
            dst + "linear_attn.dt_bias": take(a + "dt_bias"),
            dst + "linear_attn.norm.weight": take(a + "o_norm.weight"),
            dst + "linear_attn.out_proj.weight": take(a + "o_proj.weight"),
        }
        for proj in ("gate_proj", "up_proj", "down_proj"):
            out[dst + f"mlp.{proj}.weight"] = take(src + f"mlp.{proj}.weight")
    if left:
        raise ValueError(f"FLA weights with no Qwen3.5 counterpart: {sorted(left)}")
    return {k: v.contiguous() for k, v in out.items()}


def convert(src: Path, dst: Path) -> None:
    """Write the Qwen3.5 form of the FLA checkpoint in ``src`` to ``dst`` (created)."""
    fla = json.loads((src / "config.json").read_text())
    if fla.get("model_type") != "gated_deltanet":
        raise ValueError(f"{src} is not an FLA gated_deltanet checkpoint (model_type {fla.get('model_type')!r})")
    cfg = qwen3_5_config(fla)
    weights = qwen3_5_weights(load_file(str(src / "model.safetensors")), cfg["num_hidden_layers"])
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    for name in COPIED:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path, help="FLA GatedDeltaNetForCausalLM checkpoint directory")
    ap.add_argument("dst", type=Path, help="output directory")
    args = ap.parse_args()
    convert(args.src, args.dst)


if __name__ == "__main__":
    main()
