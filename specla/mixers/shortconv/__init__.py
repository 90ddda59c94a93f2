"""The gated short convolution (LFM2's conv-only mixer): its mixer and records; the convolution
itself is the shared tree-aware one of :mod:`specla.ops.conv`."""
