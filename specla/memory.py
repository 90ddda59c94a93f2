"""Memory budgeting of the caches that grow with the sequence (an attention layer's KV cache, the
EAGLE drafter's pair cache): the capacity a run sizes them for and the check that refuses, before
allocating, caches no memory can hold (docs/architecture.md: "Mixers" on the capacity, "Drafters"
on the check)."""

from __future__ import annotations

import contextlib

import torch

from .errors import ConfigError
from .step import step_depth


def cache_capacity(current: int, longest_prompt: int, config) -> int:
    """Tokens per sequence a growing cache (an attention layer's KV cache, the EAGLE drafter's
    pair cache) is sized for: the longest prompt + ``max_new_tokens`` + the draft depth + 2,
    rounded up to a power of two of at least 256, and never below ``current`` (a new size means
    new CUDA graphs, so batches of other prompt lengths reuse the recorded ones).

    Args:
        current: the capacity so far (``0`` at first). longest_prompt: tokens. config: the run's
            :class:`~specla.config.SpecConfig`.
    """
    need = longest_prompt + config.max_new_tokens + step_depth(config) + 2
    return max(current, 1 << max(need - 1, 255).bit_length())


def check_cache_memory(new_bytes: int, held_bytes: int, device: torch.device, what: str, config) -> None:
    """Refuse, before allocating, caches that cannot fit: a large ``max_new_tokens`` (left to an
    EOS to end the run) sizes caches that no allocator can give, and on a CPU the process would
    be killed, not told.

    Args:
        new_bytes: what the caches about to be allocated take; held_bytes: what the caches they
            replace take (freed with them). device: where they live. what: their name, for the
            message. config: the run's :class:`~specla.config.SpecConfig`.
    Raises:
        ConfigError: ``new_bytes`` exceeds the device's free memory plus ``held_bytes`` (CUDA:
            ``torch.cuda.mem_get_info`` plus the allocator's reserved but unused memory; Linux:
            ``MemAvailable``; elsewhere nothing is checked).

    A guard against sizes no run can hold, not an exact budget: CUDA graphs keep their own copy
    of the state per recorded batch size, so on a GPU caches that pass can still run out of
    memory later (``torch.OutOfMemoryError``, an exception, where a CPU process is killed).
    """
    if new_bytes <= held_bytes:  # no larger than what it replaces: nothing to ask the device (its query is slow)
        return
    device = torch.device(device)
    free = None
    if device.type == "cuda":  # free on the device + what torch's allocator holds unused
        free = (torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device)
                - torch.cuda.memory_allocated(device))
    elif device.type == "cpu":
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open("/proc/meminfo") as f:
                free = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    if free is not None and new_bytes > free + held_bytes:
        raise ConfigError(f"{what} would take {new_bytes / 2**30:.2f} GiB for max_new_tokens="
                          f"{config.max_new_tokens} (they are sized for the longest prompt + max_new_tokens before "
                          f"decoding); {(free + held_bytes) / 2**30:.2f} GiB of {device.type} memory is available: "
                          "lower max_new_tokens or the batch")
