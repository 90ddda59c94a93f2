"""Architecture-agnostic operators the plugins share (FLA keeps the like in ``fla.modules``):
tree-aware short convolution (PyTorch, sequential twin, Triton kernels), normalisations, and softmax
attention under a draft tree over a fixed-capacity KV cache with its commit (``attention``).
Nothing here names an architecture."""
