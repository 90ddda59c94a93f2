"""Mamba2's state-space duality (SSD) recurrence: its mixer, Triton kernels, batched PyTorch
reference and sequential twin."""
