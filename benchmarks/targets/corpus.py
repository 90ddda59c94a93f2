"""Reading the training corpus (``../shared/data/corpus``: JSONL.xz, one ``{"source", "text"}`` a line).

The split is deterministic: document ``i`` of each file is held out iff ``i % 50 == 0`` (2%).
"""

from __future__ import annotations

import json
import lzma
from pathlib import Path
from typing import Iterator

FILES = ("python_stdlib", "python_docs", "linux_docs", "sharegpt_chat", "gsm8k_train")
HELD_OUT_EVERY = 50


def documents(corpus_dir: str | Path, split: str = "train") -> Iterator[str]:
    """Texts of ``split`` (``train`` or ``heldout``), file by file in a fixed order.

    Raises:
        FileNotFoundError: a corpus file is missing.
        ValueError: unknown split.
    """
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    for name in FILES:
        with lzma.open(Path(corpus_dir) / f"{name}.jsonl.xz", "rt", encoding="utf-8") as fh:
            for i, line in enumerate(fh):
                if (i % HELD_OUT_EVERY == 0) == (split == "heldout"):
                    yield json.loads(line)["text"]
