"""Kimi Delta Attention (KDA: the gated delta rule with GLA's per-key-channel decay): its mixer,
batched PyTorch reference (which builds on GLA's) and sequential twin."""
