"""Softmax attention under a draft tree over a KV cache of fixed capacity: its mixer, record,
batched PyTorch reference and sequential twin."""
