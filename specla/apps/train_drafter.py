"""Training the EAGLE drafter on features of the target's own recurrent execution
(``specla train-drafter``).

Features are collected with the target's adapter (the same code that verifies): teacher forcing
over windows of the given texts, and over the target's own greedy continuations of prompts taken
from those texts (so the drafter learns what the target actually says). The head is trained with a
loss unrolled over draft levels (a level reads the previous level's prediction and attends
to what a draft node of its depth sees), minimising ``smooth_l1(f_hat, f) + ce_weight * CE(p_target, softmax(lm_logits(f_hat)))`` (EAGLE's
feature regression plus a soft cross-entropy through the target's LM head).
"""

from __future__ import annotations

import json
import random
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm.auto import tqdm

from ..drafters.eagle import EagleHead, is_eagle_dir
from ..errors import DrafterError
from ..hf import tensors_only
from ..interfaces import TargetAdapter
from .jsonl import read_jsonl
from .paths import unwritable


@dataclass
class DrafterTrainConfig:
    """Options of :func:`train_drafter` (the CLI flags of ``specla train-drafter``).

    Attributes:
        steps: optimiser steps.
        batch_windows: windows per step.
        window: tokens per training window.
        max_tokens: teacher-forced corpus tokens to collect: whole texts are added until at least
            this many are reached (before self-distillation).
        distill_prompts: prompts whose greedy continuation by the target is added (0: none).
        distill_prompt_tokens, distill_new_tokens: their prompt and continuation lengths.
        lr: peak AdamW learning rate (linear warm-up 5%, cosine to 10%).
        ce_weight: weight of the soft cross-entropy term.
        unroll: draft levels the loss is unrolled over (:func:`unrolled_loss`).
        num_heads: the head's attention heads (``None``: ``hidden // 64``; ``0``: no attention).
        save_every: steps between checkpoints (``checkpoint.pt``, resumable).
        seed: data order and initialisation.

    Raises:
        DrafterError: a count, ``lr`` or ``unroll`` that is not positive; ``max_tokens``,
            ``distill_prompts`` or ``ce_weight`` below 0; ``window < max(3, unroll + 1)``.
    """

    steps: int = 2000
    batch_windows: int = 32
    window: int = 128
    max_tokens: int = 400_000
    distill_prompts: int = 256
    distill_prompt_tokens: int = 48
    distill_new_tokens: int = 96
    lr: float = 1e-3
    ce_weight: float = 1.0
    unroll: int = 3
    num_heads: int | None = None
    save_every: int = 500
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "batch_windows", "save_every", "lr", "unroll", "distill_prompt_tokens",
                     "distill_new_tokens"):
            if getattr(self, name) <= 0:
                raise DrafterError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("max_tokens", "distill_prompts", "ce_weight"):
            if getattr(self, name) < 0:
                raise DrafterError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.window < max(3, self.unroll + 1):  # level k needs k pairs before the window ends
            raise DrafterError(f"window must be >= max(3, unroll + 1) = {max(3, self.unroll + 1)}, got {self.window}")


@contextmanager
def _matmul_precision(precision: str | None):
    """``torch.set_float32_matmul_precision(precision)`` inside the block (``None``: unchanged)."""
    before = torch.get_float32_matmul_precision()
    if precision:
        torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def read_texts(files: list[str | Path]) -> list[str]:
    """Texts from JSONL files (optionally ``.xz``): the ``text`` field, else ``prompt``.

    Every file is checked to exist before any is read (a typo in the last of several large
    files is reported at once).

    Raises:
        FileNotFoundError: a file is missing (the message names every missing one).
        ValueError: naming the file and line: a line that is not JSON (see
            :func:`specla.apps.jsonl.read_jsonl`). DrafterError (a ValueError), naming the file and
            line: a row that is not a JSON object, has neither field, or whose text is not a
            string.
    """
    missing = [str(f) for f in files if not Path(f).is_file()]
    if missing:
        raise FileNotFoundError(f"data file{'s' if len(missing) > 1 else ''} not found: {', '.join(missing)}")
    out = []
    for f in files:
        for i, row in read_jsonl(f):
            if not isinstance(row, dict):
                raise DrafterError(f"{f}:{i}: row is not a JSON object")
            text = row.get("text", row.get("prompt"))
            if text is None:
                raise DrafterError(f"{f}:{i}: row has neither 'text' nor 'prompt'")
            if not isinstance(text, str):
                raise DrafterError(f"{f}:{i}: 'text'/'prompt' must be a string, got {type(text).__name__}")
            out.append(text)
    return out


@torch.no_grad()
def collect_features(adapter: TargetAdapter, sequences: list[list[int]], window: int, batch: int = 16):
    """Teacher-forced target features of ``sequences`` cut into windows of ``window`` tokens.

    Returns:
        ``(tokens [W, window] int64, features [W, window, hidden])`` on the CPU, features in the
        adapter's dtype.
    """
    wins = [s[i : i + window] for s in sequences for i in range(0, len(s) - window + 1, window)]
    toks, feats = [], []
    for i in tqdm(range(0, len(wins), batch), desc="features", unit="batch", leave=False, disable=None):
        x = torch.tensor(wins[i : i + batch], dtype=torch.int64)
        _, hidden = adapter.score(x, return_hidden=True)
        toks.append(x)
        feats.append(hidden.cpu())
    return torch.cat(toks), torch.cat(feats)


def unrolled_loss(head: EagleHead, adapter: TargetAdapter, tokens: Tensor, feats: Tensor, ce_weight: float,
                  unroll: int = 2) -> Tensor:
    """The EAGLE loss unrolled over ``unroll`` draft levels, each level seeing exactly what a
    draft node of that depth sees.

    Pair ``P`` is ``(f_P, x_{P+1})`` and predicts ``f_{P+1}``. Level 1 reads the target's true
    features with causal attention over the true pairs. Level ``k`` reads at ``P`` the level
    ``k - 1`` prediction made at ``P - 1`` and attends to the true pairs up to ``P - k + 1`` and
    to the level-``j`` pairs at ``P - k + j`` (``j = 2..k``: its draft ancestors and itself).
    Each level adds ``smooth_l1(f_hat, f) + ce_weight * CE(p_target, softmax(lm_logits(f_hat)))``.

    Args:
        tokens: ``[b, T]`` int64 windows; feats: ``[b, T, hidden]`` float32 target features.
    Returns:
        the scalar loss (float32).
    """
    emb = adapter.embed(tokens[:, 1:])
    target = feats[:, 1:]
    with torch.no_grad():
        p = torch.softmax(adapter.lm_logits(target).float(), -1)
    h1 = head.pair(feats[:, :-1], emb)
    heads = head.num_heads
    true_q = true_k = true_v = None
    if heads:
        true_q, true_k, true_v = head.qkv_heads(h1)
        scale = true_q.shape[-1] ** -0.5
        n = h1.shape[1]
        pos = torch.arange(n, device=h1.device)
    total, prev, levels = 0.0, None, []  # levels: (k, v) of the predicted pairs of levels 2..k
    for k in range(1, unroll + 1):
        if k == 1:
            h, q = h1, true_q
        else:  # shift by one: the level k - 1 prediction made at P - 1 is read at P
            h = head.pair(F.pad(prev[:, :-1], (0, 0, 1, 0)), emb)
            if heads:
                q, kk, vv = head.qkv_heads(h)
                levels.append((kk, vv))
        attended = None
        if heads:
            visible = pos[None, :] <= pos[:, None] - (k - 1)  # [P, S]: true pairs up to P - k + 1
            s_true = torch.einsum("bphd,bshd->bhps", q, true_k) * scale
            s_true = s_true.masked_fill(~visible, float("-inf"))
            diag = []  # level j's pair at P - (k - j): its score and value
            for j, (kj, vj) in enumerate(levels, start=2):
                shift = k - j
                kj, vj = F.pad(kj, (0, 0, 0, 0, shift, 0))[:, :n], F.pad(vj, (0, 0, 0, 0, shift, 0))[:, :n]
                diag.append(((q * kj).sum(-1).transpose(1, 2)[..., None] * scale, vj))
            acc = torch.promote_types(q.dtype, torch.float32)
            w = torch.softmax(torch.cat([s_true] + [sd for sd, _ in diag], -1).to(acc), -1).to(q.dtype)
            attended = torch.einsum("bhps,bshd->bphd", w[..., :n], true_v)
            for i, (_, vj) in enumerate(diag):
                attended = attended + w[..., n + i].transpose(1, 2)[..., None] * vj
        pred = head.finish(h, attended)
        f_hat, f = pred[:, k - 1 :], target[:, k - 1 :]  # positions with k - 1 earlier pairs
        logq = torch.log_softmax(adapter.lm_logits(f_hat).float(), -1)
        total = total + F.smooth_l1_loss(f_hat.float(), f.float()) - ce_weight * (p[:, k - 1 :] * logq).sum(-1).mean()
        prev = pred
    return total


# what a run writes into its --out folder (and all that --overwrite removes)
DRAFTER_FILES = ("config.json", "model.safetensors", "training.json", "checkpoint.pt", "checkpoint.tmp")


def check_output(out: str | Path, cfg: DrafterTrainConfig, *, resume: bool = False,
                 overwrite: bool = False) -> dict | None:
    """Check that a training run may write its drafter into ``out``, and return the checkpoint
    it resumes from (``None``: it starts from step 0). Reads ``out/checkpoint.pt`` at most;
    leaves nothing behind (a temporary file, gone once closed, tries that ``out`` can be written).

    ``out`` may be missing or hold other files; a file a run writes (:data:`DRAFTER_FILES`)
    already there is never replaced silently: ``resume`` continues from ``out/checkpoint.pt``
    (to the same or a larger ``cfg.steps``: only ``steps`` and ``save_every`` may differ from the
    checkpoint's options), ``overwrite`` replaces the drafter there (its files are removed once
    the data has been checked, just before training).

    Args:
        out: the output folder; cfg: the run's options (compared with the checkpoint's);
        resume, overwrite: as in :func:`train_drafter` (``--resume``, ``--overwrite``).
    Raises:
        DrafterError: both ``resume`` and ``overwrite``; ``out`` exists and is not a directory;
            ``out`` cannot be made or written in (its nearest existing folder refuses a file, or
            is a file: see :func:`specla.apps.paths.unwritable`);
            ``out`` holds a ``config.json`` that is not a drafter's (a model checkpoint, e.g. the
            target's own folder), whatever the flags;
            ``out`` holds drafter files and neither ``overwrite`` nor ``resume`` with a
            checkpoint there (the message names the folder); a checkpoint that cannot be read
            or holds anything but tensors, containers and numbers (it is loaded with
            ``weights_only=True``: no code in it runs), was written with other options (each
            named), or has already passed ``cfg.steps``.
    """
    out = Path(out)
    if resume and overwrite:
        raise DrafterError("--resume (resume=True) continues the drafter in the output folder and --overwrite "
                           "(overwrite=True) replaces it: pass one of them")
    if out.exists() and not out.is_dir():
        raise DrafterError(f"output folder {out} exists and is not a directory")
    if problem := unwritable(out):  # found now, not after the target has loaded and the windows are built
        raise DrafterError(f"output folder {out} (--out) cannot be created or written ({problem})")
    ckpt = out / "checkpoint.pt"
    if (out / "config.json").is_file() and not is_eagle_dir(out):  # e.g. --out is the target's own folder
        raise DrafterError(f"output folder {out} holds a config.json that is not a drafter's (a model checkpoint?); "
                           "train-drafter never replaces it, even with --overwrite: choose another folder")
    existing = [name for name in DRAFTER_FILES if (out / name).exists()]
    if overwrite or not existing:
        return None
    if not resume:
        raise DrafterError(f"output folder {out} already holds a drafter ({', '.join(existing)}): continue its "
                           "training with --resume (resume=True), replace it with --overwrite (overwrite=True), "
                           "or choose another folder")
    if not ckpt.is_file():
        raise DrafterError(f"--resume: output folder {out} holds a drafter ({', '.join(existing)}) but no "
                           "checkpoint.pt to resume from: replace it with --overwrite (overwrite=True), or choose "
                           "another folder")
    try:  # tensors, dicts, lists and numbers only: a pickle that would run code is refused, not run
        with tensors_only(f"--resume: {ckpt}", DrafterError,
                          "resume only from a checkpoint.pt that train-drafter wrote, or start afresh with "
                          "--overwrite"):
            state = torch.load(ckpt, map_location="cpu", weights_only=True)
    except DrafterError:
        raise
    except Exception as err:  # torch.load raises pickle, zip and runtime errors alike
        raise DrafterError(f"--resume: {ckpt} is not a readable checkpoint ({type(err).__name__}: {err})") from err
    if not isinstance(state, dict) or "step" not in state:
        raise DrafterError(f"--resume: {ckpt} is not a specla train-drafter checkpoint")
    saved = state.get("config")
    if saved is not None:
        ours = {k: v for k, v in asdict(cfg).items() if k not in ("save_every", "steps")}
        diff = {k: (saved.get(k), v) for k, v in ours.items() if saved.get(k) != v}
        if diff:
            raise DrafterError("--resume: the checkpoint was written with other options ("
                               + ", ".join(f"{k} {a!r} there, {b!r} now" for k, (a, b) in diff.items())
                               + "); resume with the same options (only --steps and --save-every may change), "
                               "or start afresh in another --out")
    if state["step"] > cfg.steps:
        raise DrafterError(f"--resume: the checkpoint in {out} is at step {state['step']}, beyond --steps "
                           f"{cfg.steps}; pass --steps {state['step']} or more")
    return state


def train_drafter(adapter: TargetAdapter, tokenizer, files: list[str | Path], out: str | Path,
                  cfg: DrafterTrainConfig, resume: bool = False, stop_at: int | None = None, log=print, *,
                  overwrite: bool = False, texts: list[str] | None = None) -> dict:
    """Collect features, train an :class:`EagleHead`, save it in ``out`` (loadable as
    ``drafter=out``). Returns the training summary (also written to ``out/training.json``).

    ``resume`` continues from ``out/checkpoint.pt``, also to a larger ``cfg.steps`` than the
    checkpoint's run had (the learning-rate schedule then follows the new total from the resumed
    step on); ``stop_at`` checkpoints and returns after that step (time-boxed runs), leaving the
    drafter unsaved until a resumed run finishes. ``overwrite`` replaces a drafter already in
    ``out`` (see :func:`check_output`). Nothing is created or removed in ``out`` before the
    options and the data have been checked and the training windows collected.

    Args:
        files: JSONL(.xz) data files (:func:`read_texts`).
        texts: their texts, when the caller has already read them with :func:`read_texts` (the
            CLI does, before loading the target); ``None`` reads ``files`` here.

    Raises:
        DrafterError: the data yields no training window; ``num_heads`` does not divide the
            target's hidden size; ``stop_at < 1``; the output folder cannot be used (see
            :func:`check_output`). These, except the first, are checked before any data is read.
        FileNotFoundError, ValueError: a data file is missing or malformed (:func:`read_texts`).
    """
    out = Path(out)
    hidden = adapter.embed(torch.zeros(1, dtype=torch.int64, device=adapter.device)).shape[-1]
    EagleHead(hidden, num_heads=cfg.num_heads)  # checks num_heads against the target now, not after the data
    if stop_at is not None and stop_at < 1:
        raise DrafterError(f"stop_at must be >= 1, got {stop_at}")
    state = check_output(out, cfg, resume=resume, overwrite=overwrite)
    ckpt = out / "checkpoint.pt"
    if stop_at is not None and stop_at >= cfg.steps:
        log(f"stop_at {stop_at} >= steps {cfg.steps}: training runs to the end")
    texts = list(read_texts(files) if texts is None else texts)  # a copy: it is shuffled below
    rng = random.Random(cfg.seed)
    torch.manual_seed(cfg.seed)
    rng.shuffle(texts)
    sequences, prompts, count = [], [], 0
    for text in texts:  # tokenize lazily: the corpus may be far larger than what is used
        if count >= cfg.max_tokens and len(prompts) >= cfg.distill_prompts:
            break
        seq = tokenizer(text, add_special_tokens=False)["input_ids"]
        if count < cfg.max_tokens:
            sequences.append(seq)
            count += len(seq)
        elif len(seq) >= cfg.distill_prompt_tokens:  # prompts come from texts not used above
            prompts.append(seq[: cfg.distill_prompt_tokens])
    if prompts:
        from ..config import SpecConfig
        from ..engine import Engine
        from ..drafters.ngram import NgramDrafter

        gen_cfg = SpecConfig(num_draft_tokens=6, max_new_tokens=cfg.distill_new_tokens, stop_at_eos=False)
        for i in tqdm(range(0, len(prompts), 32), desc="self-distillation", leave=False, disable=None):
            batch = prompts[i : i + 32]
            outputs, _ = Engine(adapter, NgramDrafter(), gen_cfg).generate(batch)
            sequences += [p + o for p, o in zip(batch, outputs)]
    if not any(len(s) >= cfg.window for s in sequences):
        raise DrafterError(f"no training window of {cfg.window} tokens in the data ({len(texts)} texts)")
    tokens, feats = collect_features(adapter, sequences, cfg.window)
    log(f"training windows: {len(tokens)} x {cfg.window} tokens ({len(prompts)} self-distilled sequences)")
    if overwrite:  # the data is good: only now is the old drafter replaced
        for name in DRAFTER_FILES:
            (out / name).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    head = EagleHead(hidden, num_heads=cfg.num_heads).to(adapter.device)
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=0.0)
    start, history = 0, []
    if state is not None:  # loaded (on the CPU) and checked above; tensors move to the head's device
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["opt"])
        start, history = state["step"], state.get("history", [])
        torch.set_rng_state(state["rng"])
        log(f"resumed from step {start}")
    elif resume:
        log(f"no {ckpt} to resume from: starting from step 0")
    warm = max(cfg.steps // 20, 1)
    # TF32 products on CUDA for the head and the LM head (the collected features are unchanged)
    with _matmul_precision("high" if adapter.device.type == "cuda" else None):
        bar = tqdm(range(start, cfg.steps), desc="train-drafter", initial=start, total=cfg.steps,
                   disable=None)
        for step in bar:
            lr = cfg.lr * min((step + 1) / warm, 0.1 + 0.45 * (1 + torch.cos(torch.tensor(torch.pi * step / cfg.steps)).item()))
            for g in opt.param_groups:
                g["lr"] = lr
            idx = torch.randint(0, len(tokens), (cfg.batch_windows,))
            x = tokens[idx].to(adapter.device)
            f = feats[idx].to(adapter.device, torch.float32)
            loss = unrolled_loss(head, adapter, x, f, cfg.ce_weight, cfg.unroll)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            if step % 50 == 0 or step == cfg.steps - 1:
                history.append({"step": step, "loss": loss.item()})
                bar.set_postfix(loss=f"{loss.item():.4f}")
            stopping = stop_at is not None and step + 1 >= stop_at
            if (step + 1) % cfg.save_every == 0 or step == cfg.steps - 1 or stopping:
                tmp = ckpt.with_suffix(".tmp")  # written then renamed: an interrupted save keeps the last one
                torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "step": step + 1,
                            "rng": torch.get_rng_state(), "history": history, "config": asdict(cfg)}, tmp)
                tmp.replace(ckpt)
            if stopping and step + 1 < cfg.steps:
                log(f"stopped at step {step + 1}; continue with --resume")
                return {"config": asdict(cfg), "windows": len(tokens), "stopped_at": step + 1, "log": history}
    head.save(out, trained_steps=cfg.steps, target_vocab_size=adapter.vocab_size)
    summary = {"config": asdict(cfg), "windows": len(tokens), "self_distilled": len(prompts), "log": history}
    (out / "training.json").write_text(json.dumps(summary, indent=1))
    return summary
