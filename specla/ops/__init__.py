"""Architecture-agnostic operators the plugins share (FLA keeps the like in ``fla.modules``):
tree-aware short convolution (PyTorch, sequential twin, Triton kernels) and normalisations.
Nothing here names an architecture."""
