"""Gated linear attention (GLA): its mixer, Triton kernels, batched PyTorch reference and sequential
twin."""
