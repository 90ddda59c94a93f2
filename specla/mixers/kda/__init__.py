"""Kimi Delta Attention (KDA: the gated delta rule with GLA's per-key-channel decay): its mixer,
batched PyTorch reference (which builds on GLA's), sequential twin and Triton kernels."""
