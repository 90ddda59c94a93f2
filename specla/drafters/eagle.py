"""Target-aligned feature drafter (EAGLE, Li et al. 2024; SpecLA section 6.2).

One layer reads the target's last-layer feature ``f_t`` and the embedding of the next token
``x_{t+1}`` and predicts the next feature ``f_{t+1}``; tokens are scored through the target's own
final norm and LM head, so the drafter shares the target's vocabulary and output geometry. Its
state is the target feature at the end of the accepted path (from the verify pass), so it follows
the accepted path exactly; deeper draft levels feed its own predicted features back in. Trees
are built by :func:`specla.drafters.pruning.build_tree`.

Architecture-independent: it needs only ``TargetAdapter.embed``, ``lm_logits``, ``last_hidden``
and ``VerifyOutput.hidden``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import SpecConfig
from ..errors import DrafterError
from ..interfaces import Drafter, TargetAdapter, VerifyOutput
from ..records import Acceptance, path_end
from ..tree import DraftTree
from ..acceptance import sampling_probs
from .pruning import build_tree, sample_tree

FORMAT = "specla-eagle-v1"


class EagleHead(nn.Module):
    """``f_next = h + W_down(silu(W_gate n) * W_up n)``, ``h = W_fc [f ; e]``, ``n = RMSNorm(h)``.

    Args:
        hidden_size: the target's hidden size.
        intermediate_size: MLP width (default ``2 * hidden_size``).
        eps: RMSNorm epsilon.
    """

    def __init__(self, hidden_size: int, intermediate_size: int | None = None, eps: float = 1e-6):
        super().__init__()
        inter = intermediate_size or 2 * hidden_size
        self.config = {"format": FORMAT, "hidden_size": hidden_size, "intermediate_size": inter, "eps": eps}
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.norm = nn.RMSNorm(hidden_size, eps=eps)
        self.gate = nn.Linear(hidden_size, inter, bias=False)
        self.up = nn.Linear(hidden_size, inter, bias=False)
        self.down = nn.Linear(inter, hidden_size, bias=False)

    def forward(self, feature: Tensor, embedding: Tensor) -> Tensor:
        """Predict the next feature.

        Args:
            feature: ``[..., hidden]`` target (or predicted) feature at position ``t``.
            embedding: ``[..., hidden]`` embedding of token ``x_{t+1}``.
        Returns:
            ``[..., hidden]`` predicted feature at ``t + 1``.
        """
        h = self.fc(torch.cat([feature, embedding], dim=-1))
        n = self.norm(h)
        return h + self.down(F.silu(self.gate(n)) * self.up(n))

    def save(self, directory: str | Path, **meta) -> None:
        """Write ``config.json`` (with ``meta``) and ``model.safetensors`` into ``directory``."""
        from safetensors.torch import save_file

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps({**self.config, **meta}, indent=1))
        save_file({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}, str(out / "model.safetensors"))

    @classmethod
    def load(cls, directory: str | Path) -> "EagleHead":
        """Load a head saved by :meth:`save`.

        Raises:
            DrafterError: the directory is not a complete EAGLE drafter of this format.
        """
        from safetensors.torch import load_file

        d = Path(directory)
        try:
            cfg = json.loads((d / "config.json").read_text()) if (d / "config.json").is_file() else {}
            if cfg.get("format") != FORMAT:
                raise DrafterError(f"{d} is not a specla EAGLE drafter (config.json format != {FORMAT!r})")
            head = cls(cfg["hidden_size"], cfg["intermediate_size"], cfg["eps"])
            head.load_state_dict(load_file(str(d / "model.safetensors")))
        except (KeyError, ValueError, OSError, RuntimeError) as err:
            if isinstance(err, DrafterError):
                raise
            raise DrafterError(f"{d}: incomplete or malformed EAGLE drafter ({type(err).__name__}: {err})") from err
        return head.eval()


def is_eagle_dir(path: str | Path) -> bool:
    """Whether ``path`` is a directory holding a saved EAGLE drafter (its config says so)."""
    cfg = Path(path) / "config.json"
    try:
        return cfg.is_file() and json.loads(cfg.read_text()).get("format") == FORMAT
    except ValueError:  # malformed JSON: EagleHead.load would say so; here it is just "not one"
        return False


class EagleDrafter(Drafter):
    """Draft trees from an :class:`EagleHead` bound to a target adapter.

    Args:
        head: the trained head (moved to the target's device and dtype on :meth:`bind`).

    Raises:
        DrafterError: on :meth:`bind`, when the head's hidden size differs from the target's.
    """

    name = "eagle"

    def __init__(self, head: EagleHead):
        self.head = head
        self.adapter: TargetAdapter | None = None
        self.feature: Tensor | None = None  # [B, hidden] target feature at the end of the accepted path
        self.generator: torch.Generator | None = None  # the draws of sampled proposals

    @classmethod
    def from_dir(cls, directory: str | Path) -> "EagleDrafter":
        """Load a drafter saved by ``specla train-drafter``."""
        return cls(EagleHead.load(directory))

    def bind(self, adapter: TargetAdapter) -> None:
        width = adapter.embed(torch.zeros(1, dtype=torch.int64, device=adapter.device)).shape[-1]
        if width != self.head.config["hidden_size"]:
            raise DrafterError(f"drafter hidden size {self.head.config['hidden_size']} != target hidden size {width}: "
                               "it was trained for another target")
        self.adapter = adapter
        self.head = self.head.to(adapter.device, adapter.dtype).eval()

    def reset(self, prompts: list[list[int]]) -> None:
        self.feature = self.adapter.last_hidden
        self.generator = None  # created at the first sampled proposal, from config.seed

    @torch.no_grad()
    def _expand(self, feature: Tensor, tokens: Tensor, k: int):
        new = self.head(feature, self.adapter.embed(tokens))
        logp = torch.log_softmax(self.adapter.lm_logits(new).float(), dim=-1)
        top = logp.topk(min(k, logp.shape[-1]), dim=-1)
        return new, top.values, top.indices

    @torch.no_grad()
    def _sample_step(self, feature: Tensor, tokens: Tensor, config: SpecConfig):
        new = self.head(feature, self.adapter.embed(tokens))
        return new, sampling_probs(self.adapter.lm_logits(new), config.temperature, config.sampling_top_k, config.top_p)

    def propose(self, contexts: list[list[int]], config: SpecConfig) -> DraftTree:
        """Greedy decoding (``temperature == 0``): the best-first, confidence-pruned tree of the
        drafter's top-``k`` tokens (:func:`build_tree`). Sampling: a tree of tokens drawn from the
        drafter's own distribution, warped like the target's (temperature, top-k, top-p), with
        that distribution attached as ``draft_probs`` (:func:`sample_tree`), so acceptance can use
        ``min(1, p / q)``; seeded by ``config.seed``. Tokens and structure come back on the CPU,
        ``draft_probs`` stays on the target's device."""
        roots = torch.tensor([c[-1] for c in contexts], dtype=torch.int64, device=self.adapter.device)
        if config.temperature > 0:
            if self.generator is None:
                self.generator = torch.Generator(device=self.adapter.device)
                self.generator.manual_seed(config.seed + 1) if config.seed is not None else self.generator.seed()
            tree = sample_tree(lambda f, t: self._sample_step(f, t, config), self.feature, roots, config, self.generator)
        else:
            tree = build_tree(lambda f, t: self._expand(f, t, config.top_k), self.feature, roots, config)
        return DraftTree(*(x.cpu() for x in (tree.tokens, tree.parents, tree.num_nodes)), draft_probs=tree.draft_probs)

    device_proposals = True

    def propose_on_device(self, roots: Tensor, config: SpecConfig) -> DraftTree:
        """The greedy tree of :meth:`propose`, padded to the budget, left on the device, with no
        host synchronisation (what :class:`specla.graphs.GraphRunner` records)."""
        return build_tree(lambda f, t: self._expand(f, t, config.top_k), self.feature, roots, config,
                          fixed_width=True)

    def graph_state(self) -> list[Tensor]:
        """``[feature]``: ``[B, hidden]``, the target feature at the end of the accepted path."""
        return [self.feature]

    def set_graph_state(self, tensors: list[Tensor]) -> None:
        (self.feature,) = tensors

    def on_commit(self, acceptance: Acceptance, out: VerifyOutput) -> None:
        end = path_end(acceptance.path, acceptance.num_accepted + 1).to(out.hidden.device)
        self.feature = out.hidden[torch.arange(out.hidden.shape[0], device=out.hidden.device), end]

    def select(self, index: Tensor) -> None:
        self.feature = self.feature.index_select(0, index.to(self.feature.device))
