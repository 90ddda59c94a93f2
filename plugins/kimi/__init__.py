"""specla plugin for transformers' Kimi Linear: KDA (per-channel gated delta rule) and MLA attention."""
