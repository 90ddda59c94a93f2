"""Target-aligned feature drafter (EAGLE, Li et al. 2024; SpecLA section 6.2).

One layer reads the target's last-layer feature ``f_t`` and the embedding of the next token
``x_{t+1}`` and predicts the next feature ``f_{t+1}``; tokens are scored through the target's own
final norm and LM head, so the drafter shares the target's vocabulary and output geometry. As in
EAGLE the layer is a decoder block: causal attention over the (feature, token) pairs of the
accepted prefix (its keys and values cached, the drafter's only growing state), then an MLP. The
attention is what lets a one-layer head copy from the context, which a small target does a lot.
The drafter state follows the accepted path exactly: after each step the accepted pairs, with the
target's true features from the verify pass, join the cache; deeper draft levels feed the
drafter's own predicted features back in and attend to the cache plus their tree ancestors.
Trees are built by :func:`specla.drafters.pruning.build_tree`.

Architecture-independent: it needs only ``TargetAdapter.embed``, ``lm_logits``, ``last_hidden``,
``prompt_hidden`` and ``VerifyOutput.hidden``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import SpecConfig
from ..errors import DrafterError
from ..memory import cache_capacity, check_cache_memory
from ..interfaces import Drafter, TargetAdapter, VerifyOutput
from ..records import Acceptance
from ..tree import DraftTree
from ..acceptance import sampling_probs
from ..ops import kernels, upload_ints
from ..ops.attention import append_kv, draft_level_attention
from .pruning import accepted_rows, build_tree, pair_rows, sample_tree

act_kernels = kernels("specla.ops.act_triton")
attention_kernels = kernels("specla.ops.attention_triton")
norm_kernels = kernels("specla.ops.norm_triton")
tree_kernels = kernels("specla.ops.draft_tree_triton")

FORMAT = "specla-eagle-v2"
FORMATS = ("specla-eagle-v1", FORMAT)  # v1: the attention-free head (num_heads = 0)
# the reset's passes over the prompt pairs take at most PAIR_PASS pairs each, a shorter prompt's
# one pass a multiple of PAIR_ROUND (zeros past the prompt), so that their GEMMs meet a handful of
# shapes per batch size whatever the prompt lengths: a GEMM shape met for the first time costs the
# host milliseconds (docs/tuning.md, "EAGLE reset pass shapes")
PAIR_PASS, PAIR_ROUND = 256, 64


class EagleHead(nn.Module):
    """One decoder block over (feature, next-token embedding) pairs:
    ``h = W_fc [f ; e]``, ``h' = h + W_o Attn(RMSNorm(h))``, ``f_next = h' + W_down(silu(W_gate n) *
    W_up n)`` with ``n = RMSNorm(h')`` (EAGLE's draft layer; no positional encoding: the target's
    recurrent features carry order).

    Args:
        hidden_size: the target's hidden size.
        intermediate_size: MLP width (default ``2 * hidden_size``).
        num_heads: attention heads (default ``hidden_size // 64``, at least 1); ``0`` leaves the
            attention out (the context-free head of format v1: the target feature alone carries
            the context).
        eps: RMSNorm epsilon.
    Raises:
        DrafterError: ``num_heads`` does not divide ``hidden_size``.
    """

    def __init__(self, hidden_size: int, intermediate_size: int | None = None, num_heads: int | None = None,
                 eps: float = 1e-6):
        super().__init__()
        inter = intermediate_size or 2 * hidden_size
        heads = max(hidden_size // 64, 1) if num_heads is None else num_heads
        if heads < 0 or (heads and hidden_size % heads):
            raise DrafterError(f"num_heads {heads} must be >= 0 and divide hidden_size {hidden_size}")
        self.config = {"format": FORMAT, "hidden_size": hidden_size, "intermediate_size": inter,
                       "num_heads": heads, "eps": eps}
        self.num_heads = heads
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        if heads:
            self.attn_norm = nn.RMSNorm(hidden_size, eps=eps)
            self.qkv = nn.Linear(hidden_size, 3 * hidden_size, bias=False)
            self.o = nn.Linear(hidden_size, hidden_size, bias=False)
        self.norm = nn.RMSNorm(hidden_size, eps=eps)
        self.gate = nn.Linear(hidden_size, inter, bias=False)
        self.up = nn.Linear(hidden_size, inter, bias=False)
        self.down = nn.Linear(inter, hidden_size, bias=False)

    # -- the pieces (shared by drafting and training)
    def pair(self, feature: Tensor, embedding: Tensor) -> Tensor:
        """``h = W_fc [f ; e]``: ``[..., hidden]`` from a feature and the next token's embedding."""
        return self.fc(torch.cat([feature, embedding], dim=-1))

    def qkv_heads(self, h: Tensor, kernels: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """Queries, keys, values ``[..., heads, hidden / heads]`` of pairs ``h [..., hidden]``
        (``kernels``: the norm in one Triton launch, no autograd)."""
        n = norm_kernels.rms_norm(h, self.attn_norm.weight, self.config["eps"]) if kernels else self.attn_norm(h)
        q, k, v = self.qkv(n).chunk(3, dim=-1)
        shape = (*h.shape[:-1], self.num_heads, h.shape[-1] // self.num_heads)
        return q.reshape(shape), k.reshape(shape), v.reshape(shape)

    def finish(self, h: Tensor, attended: Tensor | None, kernels: bool = False) -> Tensor:
        """``f_next`` from the pair ``h [..., hidden]`` and its attention output
        ``[..., heads, hidden / heads]`` (``None`` without attention). ``kernels``: the norm and
        SwiGLU in one Triton launch each, the residual adds inside the output GEMMs, which write
        into ``h``'s buffer (in-place ``addmm_``: an out-of-place ``addmm`` first copies ``h``, one
        more launch each; no autograd): the result is ``h`` itself when ``h`` is contiguous."""
        if not kernels:
            if attended is not None:
                h = h + self.o(attended.flatten(-2).to(h.dtype))
            n = self.norm(h)
            return h + self.down(F.silu(self.gate(n)) * self.up(n))
        shape, H = h.shape, h.shape[-1]
        h = h.reshape(-1, H)
        if attended is not None:
            h.addmm_(attended.reshape(-1, H).to(h.dtype), self.o.weight.T)
        gu = norm_kernels.rms_norm(h, self.norm.weight, self.config["eps"]) @ self._gate_up().T
        return h.addmm_(act_kernels.swiglu(gu, self.gate.weight.shape[0]), self.down.weight.T).view(shape)

    def _gate_up(self) -> Tensor:
        """``[W_gate ; W_up]`` stacked (one GEMM), refreshed when the weights are replaced or
        changed in place (their version counters: ``load_state_dict``, ``copy_``, an optimiser
        step). A refresh of the same shape writes into the same buffer, which is what a recorded
        step reads; a step recorded earlier sees the new weights only from the next call made
        outside its replays, like every weight a plugin prepares when a decoder is built."""
        g, u = self.gate.weight, self.up.weight
        key = (g.data_ptr(), u.data_ptr(), g._version, u._version, g.dtype, g.device)
        if getattr(self, "_gu_key", None) != key:
            new = torch.cat([g, u]).detach()
            old = getattr(self, "_gu", None)
            if old is not None and (old.shape, old.dtype, old.device) == (new.shape, new.dtype, new.device):
                old.copy_(new)
            else:
                self._gu = new
            self._gu_key = key
        return self._gu

    def forward(self, feature: Tensor, embedding: Tensor) -> Tensor:
        """Teacher-forced prediction over whole sequences (each pair attends to itself and every
        earlier pair).

        Args:
            feature: ``[B, T, hidden]`` target features ``f_t``; embedding: ``[B, T, hidden]``
                embeddings of ``x_{t+1}``.
        Returns:
            ``[B, T, hidden]`` predicted features ``f_{t+1}``.
        """
        h = self.pair(feature, embedding)
        if not self.num_heads:
            return self.finish(h, None)
        q, k, v = (x.transpose(1, 2) for x in self.qkv_heads(h))
        return self.finish(h, F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2))

    def step(self, h: Tensor, anc_k: Tensor, anc_v: Tensor, cache_k: Tensor, cache_v: Tensor,
             cache_len: Tensor, kernels: bool = False, slot: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """One draft level: pairs ``h [B, M, hidden]`` attend to their sequence's cache and to
        their own tree ancestors and themselves
        (:func:`specla.ops.attention.draft_level_attention`).

        Args:
            anc_k, anc_v: ``[B, P, A, heads, d]`` the ancestors' keys and values (``A`` may be 0)
                of the previous level's ``P`` nodes; slot: ``[B, M]`` int64, the row each pair
                hangs from (``None``: row ``m``, ``P == M``).
            cache_k, cache_v: ``[B, L, heads, d]`` the accepted prefix; ``cache_len [B]`` int64
                entries valid per sequence.
            kernels: the Triton forms (one launch for the attention with its gathers, the norms
                and SwiGLU; float32 or bfloat16 inputs, no autograd): what a recorded step runs
                on a GPU. ``h``'s buffer then holds ``f_next`` (see :meth:`finish`).
        Returns:
            ``(f_next [B, M, hidden], keys, values [B, M, A + 1, heads, d])`` (the ancestors
            with the pairs themselves appended: what their children attend to).
        """
        if not self.num_heads:
            return self.finish(h, None, kernels), anc_k, anc_v
        q, k, v = self.qkv_heads(h, kernels)
        level = attention_kernels.draft_level_attention if kernels else draft_level_attention
        kw = dict(out_dtype=h.dtype) if kernels else {}
        out, keys, values = level(q, k, v, cache_k, cache_v, cache_len, anc_k, anc_v, slot, **kw)
        return self.finish(h, out, kernels), keys, values

    def save(self, directory: str | Path, **meta) -> None:
        """Write ``config.json`` (with ``meta``) and ``model.safetensors`` into ``directory``."""
        from safetensors.torch import save_file

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps({**self.config, **meta}, indent=1))
        save_file({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}, str(out / "model.safetensors"))

    @classmethod
    def load(cls, directory: str | Path) -> "EagleHead":
        """Load a head saved by :meth:`save` (format v2, or v1: the attention-free head).

        Raises:
            DrafterError: the directory is not a complete EAGLE drafter of these formats; its
                ``model.safetensors`` cannot be read (truncated or corrupt: the message names it).
        """
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        d = Path(directory)
        try:
            cfg = json.loads((d / "config.json").read_text()) if (d / "config.json").is_file() else {}
            if cfg.get("format") not in FORMATS:
                raise DrafterError(f"{d} is not a specla EAGLE drafter (config.json's format is "
                                   f"{cfg.get('format')!r}; this specla reads {', '.join(FORMATS)})")
            heads = cfg["num_heads"] if cfg["format"] == FORMAT else 0
            head = cls(cfg["hidden_size"], cfg["intermediate_size"], heads, cfg["eps"])
            state, expected = load_file(str(d / "model.safetensors")), head.state_dict()
            # one line naming the first disagreement, not torch's line per parameter
            wrong = [n for n in expected if n in state and state[n].shape != expected[n].shape]
            if wrong:
                more = f" ({len(wrong) - 1} more parameters differ)" if len(wrong) > 1 else ""
                raise DrafterError(f"drafter {d}: model.safetensors does not match config.json: {wrong[0]} is "
                                   f"{list(state[wrong[0]].shape)} in model.safetensors, "
                                   f"{list(expected[wrong[0]].shape)} by config.json{more}")
            missing, extra = [n for n in expected if n not in state], [n for n in state if n not in expected]
            if missing or extra:
                raise DrafterError(f"drafter {d}: model.safetensors does not match config.json: missing "
                                   f"{', '.join(missing) or 'none'}; unexpected {', '.join(extra) or 'none'}")
            head.load_state_dict(state)
            head.target_vocab_size = cfg.get("target_vocab_size")  # written by train-drafter
        except SafetensorError as err:
            raise DrafterError(f"{d / 'model.safetensors'} cannot be read ({err}): the drafter's weights file is "
                               "truncated or corrupt") from err
        except (KeyError, ValueError, OSError, RuntimeError) as err:
            if isinstance(err, DrafterError):
                raise
            raise DrafterError(f"{d}: incomplete or malformed EAGLE drafter ({type(err).__name__}: {err})") from err
        return head.eval()


def kernel_forms(adapter: TargetAdapter) -> bool:
    """Whether a drafter bound to ``adapter`` takes the Triton forms of its draft levels: where
    the target runs its kernels (a GPU, or the interpreter in tests), in float32 or bfloat16."""
    return bool(getattr(adapter, "triton_kernels", False)) and adapter.dtype in (torch.float32, torch.bfloat16)


def saved_format(path: str | Path):
    """The ``format`` that ``path/config.json`` names (a drafter's, maybe of another specla
    version), else None (no such file, no such key, or not a JSON object)."""
    cfg = Path(path) / "config.json"
    try:
        value = json.loads(cfg.read_text()) if cfg.is_file() else None
    except ValueError:  # malformed JSON: EagleHead.load would say so; here it is just "none"
        return None
    return value.get("format") if isinstance(value, dict) else None


def is_eagle_dir(path: str | Path) -> bool:
    """Whether ``path`` is a directory holding a saved EAGLE drafter (its config says so)."""
    return saved_format(path) in FORMATS


class EagleDrafter(Drafter):
    """Draft trees from an :class:`EagleHead` bound to a target adapter.

    State per sequence (all on the target's device): the target feature at the end of the
    accepted path ``[B, hidden]``, the root token ``[B]``, and the attention cache of the accepted
    pairs ``[B, L, heads, hidden / heads]`` (keys and values) with its valid length ``[B]``
    int64. ``L`` is fixed for a batch, so CUDA graphs can hold the cache: the longest prompt +
    ``max_new_tokens`` + ``D`` + 2 rounded up to a power of two (at least 256), and never smaller
    than for an earlier batch of this drafter (so recorded graphs stay valid across batches).

    Args:
        head: the trained head (moved to the target's device and dtype on :meth:`bind`).

    Raises:
        DrafterError: on :meth:`bind`, when the head's hidden size differs from the target's, or
            the vocabulary size of the target it was trained for (``train-drafter`` records it) does.
    """

    name = "eagle"

    def __init__(self, head: EagleHead):
        self.head = head
        self.adapter: TargetAdapter | None = None
        # [B, hidden] the target's last-layer feature at the end of the accepted path (before
        # _features: the pairs of a step are gathered from verify's features in one launch)
        self.feature: Tensor | None = None
        self.root: Tensor | None = None  # [B] the token the next tree hangs from
        self.cache_k = self.cache_v = self.cache_len = None
        self.capacity = 0  # cache entries per sequence (see reset)
        self.generator: torch.Generator | None = None  # the draws of sampled proposals
        self.kernels = False  # Triton forms of a draft level (decided on bind)

    @classmethod
    def from_dir(cls, directory: str | Path) -> "EagleDrafter":
        """Load a drafter saved by ``specla train-drafter``."""
        return cls(EagleHead.load(directory))

    def bind(self, adapter: TargetAdapter) -> None:
        width = adapter.embed(torch.zeros(1, dtype=torch.int64, device=adapter.device)).shape[-1]
        if width != self.head.config["hidden_size"]:
            raise DrafterError(f"drafter hidden size {self.head.config['hidden_size']} != target hidden size {width}: "
                               "it was trained for another target")
        vocab = getattr(self.head, "target_vocab_size", None)
        if vocab is not None and vocab != adapter.vocab_size:
            raise DrafterError(f"the drafter was trained for a target with a vocabulary of {vocab} tokens, this one "
                               f"has {adapter.vocab_size}: it was trained for another target")
        self.adapter = adapter
        self.head = self.head.to(adapter.device, adapter.dtype).eval()
        self.kernels = kernel_forms(adapter)

    @torch.no_grad()
    def reset(self, prompts: list[list[int]]) -> None:
        """Start from prefill: the last prompt feature, and every earlier prompt pair
        ``(f_p, x_{p+1})`` in the cache (from ``adapter.prompt_hidden``; an adapter without it
        starts the cache empty).

        Raises:
            ConfigError: the cache, sized for the longest prompt + ``max_new_tokens``, would not
                fit in the device's free memory (nothing changed).
        """
        ad, cfg = self.adapter, self.adapter.config
        B, dev = len(prompts), ad.device
        heads, d = self._cache_heads()
        # sized from the adapter's config, the run's (an Engine given a larger max_new_tokens
        # would fill the cache: later pairs then overwrite its last slot, which costs acceptance,
        # never exactness)
        cap = cache_capacity(self.capacity, max(len(p) for p in prompts), cfg) if heads else 0
        size = ad.dtype.itemsize * max(heads, 1) * d * 2
        held = 0 if self.cache_k is None else self.cache_k.shape[0] * self.cache_k.shape[1] * size
        check_cache_memory(B * cap * size, held, dev, "the EAGLE drafter's key/value cache", cfg)
        self.capacity = cap
        self.feature = ad.last_hidden
        self.generator = None  # created at the first sampled proposal, from config.seed
        self.cache_k = torch.zeros(B, cap, max(heads, 1), d, dtype=ad.dtype, device=dev)
        self.cache_v = torch.zeros_like(self.cache_k)
        lengths = [max(len(p) - 2, 0) for p in prompts]
        hidden = getattr(ad, "prompt_hidden", None)
        T = max(lengths) if heads and hidden is not None else 0
        P = min(PAIR_PASS, -(-T // PAIR_ROUND) * PAIR_ROUND)  # pairs per pass
        n = -(-T // P) if T else 0  # passes
        pairs = [p[1 : 1 + T] + [0] * (n * P - len(p[1 : 1 + T])) for p in prompts]  # zeros past T: dropped
        # one upload that does not stall the host (upload_ints): roots, cache lengths, each pass's
        # first position (per sequence) and its pair tokens (contiguous per pass)
        up = upload_ints([p[-1] for p in prompts] + (lengths if T else [0] * B)
                         + [c * P for c in range(n) for _ in range(B)]
                         + [t for c in range(n) for p in pairs for t in p[c * P : (c + 1) * P]], dev)
        self.root, self.cache_len = up[:B], up[B : 2 * B]
        if T:
            starts, tokens = up[2 * B : (2 + n) * B].view(n, B), up[(2 + n) * B :].view(n, B, P)
            feats = F.pad(hidden[:, :T].to(ad.dtype), (0, 0, 0, n * P - T))
            for c in range(n):
                k, v = self._pair_kv(self._features(feats[:, c * P : (c + 1) * P]), tokens[c], starts[c])
                w = min(P, T - c * P)
                self.cache_k[:, c * P : c * P + w], self.cache_v[:, c * P : c * P + w] = k[:, :w], v[:, :w]

    # -- what a drafter of this shape with another head overrides (the model's own MTP layer)
    def _cache_heads(self) -> tuple[int, int]:
        """``(heads, head dim)`` of the attention cache (``heads`` 0: no attention)."""
        heads = self.head.num_heads
        return heads, self.head.config["hidden_size"] // max(heads, 1)

    def _features(self, hidden: Tensor) -> Tensor:
        """The drafter's feature of target features ``[..., hidden]`` (EAGLE: the features
        themselves)."""
        return hidden

    def _pair_kv(self, feats: Tensor, tokens: Tensor, start: Tensor) -> tuple[Tensor, Tensor]:
        """Cache keys and values ``[B, W, heads, d]`` of the pairs (feature ``[B, W, hidden]``,
        next token ``[B, W]``) at positions ``start [B] + 0 .. W - 1`` (EAGLE has no positional
        encoding)."""
        _, k, v = self.head.qkv_heads(self.head.fc(self._pairs(feats, None, tokens)), self.kernels)
        return k, v

    def _pairs(self, feats: Tensor, slot: Tensor | None, tokens: Tensor) -> Tensor:
        """``[B, M, 2 hidden]``: the features ``feats [B, P, hidden]`` (row ``slot [B, M]``, or
        row ``m`` with ``slot`` ``None``) beside the embeddings of ``tokens [B, M]``: the input of
        the head's ``fc``. With the kernels and an embedding table, the lookup, the gather and the
        concatenation are one launch."""
        table = self.adapter.embedding_table()
        if self.kernels and table is not None:
            return tree_kernels.pair_rows(feats, slot, table, tokens=tokens)
        return (tree_kernels.pair_rows if self.kernels else pair_rows)(feats, slot, self.adapter.embed(tokens))

    def _root_state(self) -> tuple[Tensor, Tensor, Tensor]:
        """The state the roots are expanded from (:meth:`_level`'s layout): the feature ``[B, 1,
        hidden]`` and no ancestors."""
        heads, d = self._cache_heads()
        none = self.feature.new_empty(self.feature.shape[0], 1, 0, max(heads, 1), d)
        return self._features(self.feature)[:, None], none, none

    def _logits(self, feature: Tensor) -> Tensor:
        """Logits ``[..., vocab]`` of predicted features: the target's final norm and LM head."""
        return self.adapter.lm_logits(feature)

    def _level(self, state: tuple[Tensor, Tensor, Tensor], slot: Tensor | None,
               tokens: Tensor) -> tuple[tuple[Tensor, Tensor, Tensor], Tensor]:
        """One draft level (see :data:`specla.drafters.pruning.ExpandFn`). ``state``: the
        previous level's ``P`` nodes' (predicted) features ``[B, P, hidden]`` and the keys and
        values of their ``A`` ancestors and themselves ``[B, P, A, heads, d]``; ``slot [B, M]``:
        the node each of the ``M`` new pairs hangs from. Returns the new nodes' state (``A + 1``)
        and their features ``[B, M, hidden]``."""
        feats, anc_k, anc_v = state
        h = self.head.fc(self._pairs(feats, slot, tokens))
        new, keys, values = self.head.step(h, anc_k, anc_v, self.cache_k, self.cache_v, self.cache_len,
                                           kernels=self.kernels, slot=slot)
        return (new, keys, values), new

    @torch.no_grad()
    def _expand(self, state, slot: Tensor | None, tokens: Tensor):
        """:data:`specla.drafters.pruning.ExpandFn`: one level and its children's logits."""
        state, new = self._level(state, slot, tokens)
        return state, self._logits(new)

    @torch.no_grad()
    def _sample_step(self, state, slot: Tensor | None, tokens: Tensor, config: SpecConfig):
        state, new = self._level(state, slot, tokens)
        return state, sampling_probs(self._logits(new), config.temperature, config.sampling_top_k, config.top_p)

    def propose(self, contexts: list[list[int]], config: SpecConfig) -> DraftTree:
        """Greedy decoding (``temperature == 0``): the best-first, confidence-pruned tree of the
        drafter's top-``k`` tokens (:func:`build_tree`). Sampling: a tree of tokens drawn from the
        drafter's own distribution, warped like the target's (temperature, top-k, top-p), with
        that distribution attached as ``draft_probs`` (:func:`sample_tree`), so acceptance can use
        ``min(1, p / q)``; seeded by ``config.seed``. Tokens and structure come back on the CPU,
        ``draft_probs`` stays on the target's device."""
        self.root = torch.tensor([c[-1] for c in contexts], dtype=torch.int64, device=self.adapter.device)
        root_state = self._root_state()
        if config.temperature > 0:
            if self.generator is None:
                self.generator = torch.Generator(device=self.adapter.device)
                self.generator.manual_seed(config.seed + 1) if config.seed is not None else self.generator.seed()
            tree = sample_tree(lambda f, s, t: self._sample_step(f, s, t, config), root_state, self.root, config,
                               self.generator)
        else:
            tree = build_tree(self._expand, root_state, self.root, config, kernels=self.kernels)
        return DraftTree(*(x.cpu() for x in (tree.tokens, tree.parents, tree.num_nodes)), draft_probs=tree.draft_probs)

    device_proposals = True

    def propose_on_device(self, roots: Tensor, config: SpecConfig) -> DraftTree:
        """The greedy tree of :meth:`propose`, padded to the budget, left on the device, with no
        host synchronisation (what :class:`specla.cuda.graph_step.GraphRunner` records)."""
        self.root = roots
        return build_tree(self._expand, self._root_state(), roots, config, fixed_width=True, kernels=self.kernels)

    def graph_state(self) -> list[Tensor]:
        """``[feature [B, hidden], root [B], cache keys, cache values [B, L, heads, d],
        cache length [B]]``."""
        return [self.feature, self.root, self.cache_k, self.cache_v, self.cache_len]

    def set_graph_state(self, tensors: list[Tensor]) -> None:
        self.feature, self.root, self.cache_k, self.cache_v, self.cache_len = tensors

    @torch.no_grad()
    def on_commit(self, acceptance: Acceptance, out: VerifyOutput) -> None:
        """Append the accepted pairs to the cache (in place, fixed shapes): the root with the
        feature it was drafted from, then each accepted node with the feature verify computed
        for its parent; the new feature is the one at the end of the path, the new root the
        bonus token. Rows whose cache is full (finished rows kept in a graph's batch) stop
        growing; their drafts are discarded anyway."""
        hidden, dev = out.hidden, out.hidden.device
        num = acceptance.num_accepted.to(dev)
        gather = tree_kernels.accepted_rows if self.kernels else accepted_rows
        feats, toks, last = gather(self.feature, hidden, acceptance.path.to(dev), num, self.root,
                                   acceptance.tokens.to(dev))
        if self._cache_heads()[0]:
            k, v = self._pair_kv(self._features(feats), toks, self.cache_len)
            append = attention_kernels.append_kv if self.kernels else append_kv
            append(self.cache_k, self.cache_v, self.cache_len, k, v, num)
        self.feature = last  # the path's last node: the root plus num_accepted nodes, never empty
        self.root = acceptance.bonus.to(dev)

    def select(self, index: Tensor) -> None:
        index = index.to(self.feature.device)
        self.feature, self.root, self.cache_k, self.cache_v, self.cache_len = (
            x.index_select(0, index) for x in self.graph_state())
