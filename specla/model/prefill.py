"""The sizes of prefill passes and what a recorded prefill pass holds
(:meth:`specla.model.adapter.ModelAdapter.prefill`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

PREFILL_PASS = 256  # prompt tokens per pass through the mixers' chunked kernels (``prefill="passes"``)
# prefill passes run as one recorded CUDA graph up to this many prompts (where a pass is bound by
# its launches); each recorded batch size keeps a pass's buffers (and a chain pass's records) in its pool
PREFILL_GRAPH_MAX_BATCH = 8


@dataclass
class PrefillGraph:
    """One recorded prefill pass for ``B`` prompts: static inputs, state and output."""

    tokens: Tensor  # [B, W] int64, the chunk (padding 0); W: PREFILL_CHUNK, or PREFILL_PASS for passes
    parents: Tensor  # [B, W] int64, a chain
    counts: Tensor  # [B] int64, the chunk's real tokens per prompt
    state: list[Tensor]  # every mixer's state, in the mixers' order
    hidden: Tensor  # [B, W, hidden] last-layer features
    graph: "torch.cuda.CUDAGraph | None" = None
