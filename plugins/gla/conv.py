"""Triton tree short-convolution kernels for GLA's optional short convolution (``use_short_conv``).

The kernels are architecture-independent (a gather over each node's last ``C - 1`` ancestors, a
``C``-tap depthwise dot product, SiLU; and the window after an accepted path), so this module
re-exports the GDN plugin's kernels rather than keeping a second copy: ``tree_conv`` and
``conv_commit``, twins of ``reference.tree_conv`` and ``reference.conv_window_after``.
"""

from specla_gdn.conv import conv_commit, tree_conv  # noqa: F401

__all__ = ["conv_commit", "tree_conv"]
