"""FLA's standard softmax-attention layer (``fla.layers.attn.Attention``), which FLA's hybrid
configurations put beside their recurrent layers (the ``attn`` option of its GDN, GLA and other
configs: ``{"layers": [...], "num_heads", "num_kv_heads", "qkv_bias", "window_size",
"rope_theta"}``), as a specla :class:`~specla.mixers.ProjectedAttention`, for the plugins of FLA's
model classes.

FLA runs that layer on flash-attn only, and refuses to build it without flash-attn installed.
specla never calls the layer's forward (the mixer runs its own tree attention over the layer's
weights), so :func:`without_flash_attn` lets FLA build it on machines without flash-attn (a CPU, a
GPU without the package).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from specla.mixers import ProjectedAttention
from specla.ops.norm import rms_norm

_lock = threading.RLock()


def _flash_attn_absent(*args, **kwargs):
    raise RuntimeError("FLA's attention layer was built by specla without flash-attn; specla runs it through "
                       "its own tree attention and never calls this forward (install flash-attn to run the model "
                       "with FLA itself)")


@contextlib.contextmanager
def without_flash_attn() -> Iterator[None]:
    """While in the block, FLA's ``Attention`` builds without flash-attn installed: the one name
    FLA's constructor checks holds a stand-in that raises ``RuntimeError`` naming the reason if
    called. After it the name holds what it held before (``None`` without flash-attn: calling
    FLA's own forward of such a layer then fails as it would in FLA). Where flash-attn is
    installed nothing is swapped. One thread at a time holds the block (re-entrant).

    Raises:
        ImportError: FLA is not installed.
    """
    import fla.layers.attn as fla_attn

    with _lock:
        saved = fla_attn.flash_attn_func
        if saved is None:
            fla_attn.flash_attn_func = _flash_attn_absent
        try:
            yield
        finally:
            fla_attn.flash_attn_func = saved


def is_fla_attention(module: torch.nn.Module) -> bool:
    """Whether ``module`` is FLA's standard attention layer."""
    from fla.layers.attn import Attention

    return isinstance(module, Attention)


@torch.no_grad()
def spread_attention_biases(attn: torch.nn.Module, std: float = 0.5) -> None:
    """Draw an FLA ``Attention`` layer's q/k/v biases (where it has them) from ``N(0, std)``, in
    place: FLA initialises them to zero, which in a tiny test model would hide a bias that is
    dropped or misapplied."""
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
        if proj.bias is not None:
            proj.bias.normal_(0.0, std)


def fla_rotary(inv_freq: Tensor, dtype: torch.dtype) -> tuple[Callable, Callable]:
    """FLA's rotary embedding (``fla.modules.RotaryEmbedding``, not interleaved, float32
    positions) as ``(rotary, apply_rotary)`` for :class:`ProjectedAttention`.

    Args:
        inv_freq: ``[Dh / 2]`` float32 inverse frequencies (``base ** (-2i / Dh)``).
        dtype: the dtype of the ``cos`` / ``sin`` tables (FLA's: the queries' dtype).
    Returns:
        ``rotary(h, positions [B, T] int64) -> (cos, sin [B, T, Dh / 2])`` and
        ``apply_rotary(q, k, cos, sin, unsqueeze_dim=2) -> (q, k)`` on ``[B, T, heads, Dh]``
        (FLA's ``rotary_embedding_ref``: ``x cos + rotate_half(x) sin`` over the two halves, in
        at least float32 and rounded to the inputs' dtype once, as FLA's kernel does).
    """
    from fla.modules.rotary.ops import rotary_embedding_ref

    def rotary(h: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        freqs = positions.to(torch.float32)[..., None] * inv_freq  # FLA: torch.outer(t, inv_freq), float32
        return freqs.cos().to(dtype), freqs.sin().to(dtype)

    def apply_rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 2) -> tuple[Tensor, Tensor]:
        # in (at least) float32, rounded once at the end, as FLA's Triton rotary kernel computes
        ct = torch.promote_types(q.dtype, torch.float32)
        cos, sin = cos.to(ct), sin.to(ct)
        return tuple(rotary_embedding_ref(x.to(ct), cos, sin).to(x.dtype) for x in (q, k))

    return rotary, apply_rotary


def fla_attention_mixer(attn: torch.nn.Module, act: Callable[[Tensor | None], Tensor | None],
                        dtype: torch.dtype, device: torch.device, *, o_proj: bool = True) -> ProjectedAttention:
    """The mixer of one FLA ``Attention`` layer.

    Args:
        attn: a ``fla.layers.attn.Attention``: ``q_proj [H Dh, hidden]``, ``k_proj`` / ``v_proj``
            ``[HKV Dh, hidden]`` (biases when ``qkv_bias``), optional ``q_norm`` / ``k_norm``
            RMSNorms over ``Dh``, ``rotary`` (its ``inv_freq`` and ``base``), ``window_size``.
        act: converts a weight to the run's device and activation dtype (:meth:`specla.model.spec.Placement.act`).
        dtype, device: the KV cache's (the activation dtype).
        o_proj: apply the output projection (``False``: the plugin's block applies it, with the
            residual add, as for its recurrent layers).
    Returns:
        a :class:`ProjectedAttention` whose output is ``[B, T, hidden]``, or ``[B, T, H Dh]``
        without ``o_proj``.
    """
    D = attn.head_dim
    inv_freq = 1.0 / (attn.rotary.base ** (torch.arange(0, D, 2, dtype=torch.float32, device=device) / D))
    rotary, apply_rotary = fla_rotary(inv_freq, dtype)

    def linear(m: torch.nn.Linear) -> Callable[[Tensor], Tensor]:
        w, b = act(m.weight), act(m.bias)
        return lambda h: F.linear(h, w, b)

    def norm(m: torch.nn.Module) -> Callable[[Tensor], Tensor]:
        w, eps = act(m.weight), m.eps
        return lambda x: rms_norm(x, w, eps).to(x.dtype)

    qk = getattr(attn, "qk_norm", False)
    return ProjectedAttention(q_proj=linear(attn.q_proj), k_proj=linear(attn.k_proj), v_proj=linear(attn.v_proj),
                              o_proj=linear(attn.o_proj) if o_proj else (lambda o: o),
                              num_kv_heads=attn.num_kv_heads, head_dim=D, dtype=dtype,
                              device=device, window=attn.window_size,
                              q_norm=norm(attn.q_norm) if qk else None, k_norm=norm(attn.k_norm) if qk else None,
                              rotary=rotary, apply_rotary=apply_rotary)


def naive_fla_attention(attn: torch.nn.Module, h: Tensor, cache: list[tuple[Tensor, Tensor]],
                        dtype: torch.dtype) -> Tensor:
    """One token through FLA's ``Attention``, sequentially: the reference the plugins' twins
    (``NaiveGDN``, ``NaiveGLA``) decode hybrids with. Projections, the rotary embedding at the
    token's position ``len(cache)`` (GPT-NeoX halves, ``base ** (-2i / Dh)``, the angles in
    float32 as FLA's ``RotaryEmbedding`` computes them, the rotation in ``dtype``), softmax over
    the keys of the last ``window_size`` tokens (all without a window), grouped-query heads
    (query head ``i`` reads key/value head ``i // (H / HKV)``), then ``o_proj``.

    Args:
        attn: a ``fla.layers.attn.Attention``. h: ``[hidden]`` the normed input.
        cache: the layer's ``(k [HKV, Dh], v [HKV, Dh])`` so far, in ``dtype``; this token's is
            appended.
        dtype: the compute dtype (float32, float64 for float64 models).
    Returns:
        ``[hidden]`` the layer's output in ``h.dtype``.
    """
    D = attn.head_dim
    lin = lambda m: (h @ m.weight.T + (m.bias if m.bias is not None else 0)).to(dtype)  # noqa: E731
    q, k, v = lin(attn.q_proj).view(-1, D), lin(attn.k_proj).view(-1, D), lin(attn.v_proj).view(-1, D)
    if getattr(attn, "qk_norm", False):
        q, k = (rms_norm(x, n.weight.to(dtype), n.eps) for x, n in ((q, attn.q_norm), (k, attn.k_norm)))
    inv_freq = 1.0 / (attn.rotary.base ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    ang = torch.tensor(float(len(cache)), dtype=torch.float32) * inv_freq
    cos, sin = torch.cos(ang).to(dtype), torch.sin(ang).to(dtype)

    def rotate(x: Tensor) -> Tensor:
        x1, x2 = x[:, : D // 2], x[:, D // 2 :]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    cache.append((rotate(k), v))
    seen = cache[-attn.window_size:] if attn.window_size else cache
    K, Vs = torch.stack([kv[0] for kv in seen], 1), torch.stack([kv[1] for kv in seen], 1)  # [HKV, L, Dh]
    q = rotate(q).view(K.shape[0], -1, D)  # query heads grouped by their key/value head
    w = torch.softmax(q @ K.transpose(1, 2) * D**-0.5, dim=-1)
    return (w @ Vs).reshape(-1).to(h.dtype) @ attn.o_proj.weight.T
