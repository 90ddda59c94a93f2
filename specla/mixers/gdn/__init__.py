"""The gated delta rule (Gated DeltaNet): its mixer, Triton kernels, batched PyTorch reference and
sequential twin."""
