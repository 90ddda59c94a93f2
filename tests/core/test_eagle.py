"""The target-aligned EAGLE drafter: exactness, persistence, training and resume (on the tiny
trained target shipped with the gdn plugin)."""

import json
import shutil
import subprocess
import sys
from importlib import resources

import pytest
import torch

import specla
from specla import SpecDecoder
from specla.drafters import EagleDrafter, make_drafter
import specla.drafters.eagle as eagle_module
from specla.drafters.eagle import EagleHead, is_eagle_dir
from specla.apps.train_drafter import DrafterTrainConfig, train_drafter
from specla_fla.oracle import naive_greedy_decode
from specla_fla.plugin import TINY_TARGET

TINY = TINY_TARGET
TINY_EAGLE = TINY.parent / "tiny-eagle"
DATA = str(resources.files("specla.apps").joinpath("data/demo_prompts.jsonl"))


def test_shipped_drafter_is_exact_in_float64():
    dec = SpecDecoder(TINY, None, drafter=str(TINY_EAGLE),
                      config=dict(dtype="float64", max_new_tokens=20, num_draft_tokens=8, max_depth=4, top_k=3))
    assert isinstance(dec.drafter, EagleDrafter)
    prompts = ["Question: Tom has 3 apples and buys 5 more. How many apples does he have?\nAnswer:", "def add(a, b):"]
    result = dec.generate(prompts)
    ids = [dec.tokenizer(p)["input_ids"] for p in prompts]
    assert result.outputs == [naive_greedy_decode(dec.model, i, len(o)) for i, o in zip(ids, result.outputs)]
    assert result.stats.mean_accepted_tokens > 0  # the trained drafter does get drafts accepted


def test_head_roundtrip_and_errors(tmp_path):
    head = EagleHead(16, 24)
    head.save(tmp_path / "d", note="x")
    assert is_eagle_dir(tmp_path / "d") and not is_eagle_dir(tmp_path)
    loaded = EagleHead.load(tmp_path / "d")
    assert loaded.num_heads == head.num_heads == 1
    f, e = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
    assert torch.equal(loaded(f, e), head(f, e))
    with pytest.raises(ValueError, match="not a specla EAGLE drafter"):
        EagleHead.load(tmp_path)
    dec = SpecDecoder(TINY, None)
    with pytest.raises(ValueError, match="drafter hidden size 16 != target hidden size 256"):
        make_drafter(str(tmp_path / "d")).bind(dec.adapter)


def _train(tmp_path, name, **kw):
    dec = SpecDecoder(TINY, None, config=dict(dtype="float32"))
    cfg = DrafterTrainConfig(steps=6, batch_windows=4, window=32, max_tokens=600, distill_prompts=2,
                             distill_new_tokens=16, save_every=3, seed=1)
    return train_drafter(dec.adapter, dec.tokenizer, [DATA], tmp_path / name, cfg, log=lambda *_: None, **kw)


def test_training_resume_equals_uninterrupted(tmp_path):
    full = _train(tmp_path, "full")
    part = _train(tmp_path, "part", stop_at=3)
    assert part["stopped_at"] == 3 and not is_eagle_dir(tmp_path / "part")
    _train(tmp_path, "part", resume=True)
    a, b = EagleHead.load(tmp_path / "full"), EagleHead.load(tmp_path / "part")
    for (k, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.allclose(x, y, atol=1e-6), k
    assert full["windows"] > 0 and len(full["log"]) >= 1


def test_train_drafter_cli_and_use(tmp_path):
    out = tmp_path / "cli"
    proc = subprocess.run(
        [sys.executable, "-m", "specla.apps.cli", "train-drafter", "--model", str(TINY), "--data", DATA,
         "--out", str(out), "--steps", "4", "--batch-windows", "4", "--window", "32", "--max-tokens", "500",
         "--distill-prompts", "2", "--device", "cpu"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["out"] == str(out)
    vocab = SpecDecoder(TINY, None, config=dict(dtype="float32")).adapter.vocab_size
    assert json.loads((out / "config.json").read_text())["target_vocab_size"] == vocab  # checked on bind
    r = specla.run(TINY, None, prompts=["def f(x):"], drafter=str(out), config=dict(max_new_tokens=8, dtype="float32"))
    ar = specla.run(TINY, None, prompts=["def f(x):"], config=dict(max_new_tokens=8, dtype="float32", num_draft_tokens=0))
    assert r.outputs == ar.outputs


def test_bad_drafter_directories_raise_drafter_errors(tmp_path):
    from specla import DrafterError, UnknownPluginError

    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text('{"format": "specla-eagle-v1"}')
    with pytest.raises(DrafterError, match="incomplete or malformed"):
        EagleHead.load(tmp_path / "broken")
    (tmp_path / "partial").mkdir()
    (tmp_path / "partial" / "checkpoint.pt").write_bytes(b"x")
    with pytest.raises(DrafterError, match="finish it with --resume"):
        make_drafter(str(tmp_path / "partial"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DrafterError, match="is not a trained drafter directory$"):
        make_drafter(tmp_path / "empty")
    (tmp_path / "file").write_text("x")
    with pytest.raises(DrafterError, match="is not a directory"):
        make_drafter(str(tmp_path / "file"))
    with pytest.raises(UnknownPluginError, match="unknown drafter 'eagle9'"):
        make_drafter("eagle9")
    dec = SpecDecoder(TINY, None, config=dict(dtype="float32"))
    with pytest.raises(DrafterError, match="no training window"):
        train_drafter(dec.adapter, dec.tokenizer, [DATA], tmp_path / "x", DrafterTrainConfig(window=100000),
                      log=lambda *_: None)


def _edited_copy(tmp_path, **fields):
    copy = tmp_path / "copy"
    shutil.copytree(TINY_EAGLE, copy)
    cfg = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**cfg, **fields}))
    return copy


def test_a_drafter_whose_weights_or_format_disagree_with_its_config_is_named_in_one_line(tmp_path):
    """Weights of other shapes than config.json's (one line with the first parameter and both
    shapes, not torch's line per parameter), weights of another head, and a format of another
    specla version (named, with the ones read) are refused by the directory's name."""
    from specla import DrafterError

    copy = _edited_copy(tmp_path, hidden_size=512)
    with pytest.raises(DrafterError) as err:
        make_drafter(copy)
    assert str(err.value) == (f"drafter {copy}: model.safetensors does not match config.json: fc.weight is "
                              "[256, 512] in model.safetensors, [512, 1024] by config.json (7 more parameters differ)")
    shutil.rmtree(copy)
    copy = _edited_copy(tmp_path, format="specla-eagle-v1")  # the attention-free head: no attention weights
    with pytest.raises(DrafterError) as err:
        make_drafter(copy)
    assert str(err.value) == (f"drafter {copy}: model.safetensors does not match config.json: missing none; "
                              "unexpected attn_norm.weight, o.weight, qkv.weight")
    shutil.rmtree(copy)
    copy = _edited_copy(tmp_path, format="specla-eagle-v9")
    with pytest.raises(DrafterError) as err:
        make_drafter(copy)
    assert str(err.value) == (f"drafter {copy}: config.json names the format 'specla-eagle-v9', which this specla "
                              "does not read (it reads specla-eagle-v1, specla-eagle-v2)")
    with pytest.raises(DrafterError) as err:
        EagleHead.load(copy)
    assert str(err.value) == (f"{copy} is not a specla EAGLE drafter (config.json's format is 'specla-eagle-v9'; "
                              "this specla reads specla-eagle-v1, specla-eagle-v2)")


def test_a_drafter_trained_for_another_vocabulary_is_refused(tmp_path):
    """``train-drafter`` records the target's vocabulary size; a drafter of the right hidden size
    bound to a target of another vocabulary is refused by name (a directory without the record,
    as the bundled drafter's, binds as before)."""
    from specla import DrafterError

    head = EagleHead.load(TINY_EAGLE)
    vocab = SpecDecoder(TINY, None, config=dict(dtype="float32")).adapter.vocab_size
    head.save(tmp_path / "other", target_vocab_size=vocab + 1)
    with pytest.raises(DrafterError, match=f"vocabulary of {vocab + 1} tokens, this one has {vocab}"):
        SpecDecoder(TINY, None, drafter=str(tmp_path / "other"), config=dict(dtype="float32"))
    head.save(tmp_path / "same", target_vocab_size=vocab)
    assert SpecDecoder(TINY, None, drafter=str(tmp_path / "same"), config=dict(dtype="float32")).drafter is not None


def test_training_config_is_validated():
    from specla import DrafterError

    with pytest.raises(DrafterError, match=r"window must be >= max\(3, unroll \+ 1\) = 4, got 1"):
        DrafterTrainConfig(window=1)
    with pytest.raises(DrafterError, match=r"= 5, got 4"):
        DrafterTrainConfig(window=4, unroll=4)
    with pytest.raises(DrafterError, match="unroll must be positive"):
        DrafterTrainConfig(unroll=0)
    with pytest.raises(DrafterError, match="num_heads 3 must be >= 0 and divide hidden_size 16"):
        EagleHead(16, num_heads=3)
    with pytest.raises(DrafterError, match="batch_windows must be positive"):
        DrafterTrainConfig(batch_windows=0)


def test_v1_directories_load_as_the_attention_free_head(tmp_path):
    """Format v1 (before the attention) is the ``num_heads=0`` head: same weights, same output."""
    head = EagleHead(16, 24, num_heads=0)
    head.save(tmp_path / "v1")
    cfg = json.loads((tmp_path / "v1" / "config.json").read_text())
    del cfg["num_heads"]
    (tmp_path / "v1" / "config.json").write_text(json.dumps({**cfg, "format": "specla-eagle-v1"}))
    assert is_eagle_dir(tmp_path / "v1")
    loaded = EagleHead.load(tmp_path / "v1")
    f, e = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
    assert loaded.num_heads == 0 and torch.equal(loaded(f, e), head(f, e))


class _Toy:
    """A stand-in target for the head alone: embeddings and a tied LM head (float64)."""

    def __init__(self, vocab: int, hidden: int, g: torch.Generator):
        self.E = torch.randn(vocab, hidden, generator=g, dtype=torch.float64)

    def embed(self, tokens):
        return self.E[tokens]

    def lm_logits(self, hidden):
        return hidden @ self.E.T


@pytest.mark.parametrize("heads", [4, 0])
def test_unrolled_training_levels_see_what_draft_levels_see(heads):
    """The training loss's level-``k`` prediction at pair ``P`` equals what drafting computes for
    a depth-``k`` node: the cache holding the true pairs before ``P - k + 1``, the root pair
    there, then ``k - 1`` levels fed their own predictions (float64, fresh random weights)."""
    from specla.apps.train_drafter import unrolled_loss

    g = torch.Generator().manual_seed(3)
    torch.manual_seed(3)
    H, b, T, unroll = 32, 2, 9, 4
    head = EagleHead(H, num_heads=heads).double()
    toy = _Toy(50, H, g)
    feats = torch.randn(b, T, H, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, 50, (b, T), generator=g)
    levels, finish = [], head.finish
    head.finish = lambda h, a: levels.append(finish(h, a)) or levels[-1]
    loss = unrolled_loss(head, toy, tokens, feats, 1.0, unroll=unroll)
    del head.finish
    assert torch.isfinite(loss) and len(levels) == unroll
    nh, d = max(heads, 1), H // max(heads, 1)
    for k in range(1, unroll + 1):
        for P in range(k - 1, T - 1):
            r = P - k + 1  # the root pair's position
            cache_k = cache_v = torch.zeros(b, r, nh, d, dtype=torch.float64)
            if heads:
                _, cache_k, cache_v = head.qkv_heads(head.pair(feats[:, :r], toy.embed(tokens[:, 1 : r + 1])))
            feature = feats[:, r][:, None]
            anc_k = anc_v = torch.zeros(b, 1, 0, nh, d, dtype=torch.float64)
            for level in range(1, k + 1):
                h = head.pair(feature, toy.embed(tokens[:, r + level][:, None]))
                feature, anc_k, anc_v = head.step(h, anc_k, anc_v, cache_k, cache_v, torch.full((b,), r))
            torch.testing.assert_close(feature[:, 0], levels[k - 1][:, P], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("graphs,pair_pass", [("off", None), ("unrecorded", None), ("off", (2, 2))])
def test_drafter_cache_follows_the_accepted_path(graphs, pair_pass, monkeypatch):
    """After decoding, the EAGLE cache holds exactly the pairs of the accepted sequence: its keys
    and values equal those computed from the target's teacher-forced features of prompt +
    output (float64; ragged prompts, random head on the trained tiny target), eagerly and with
    the fixed-shape graph step (unrecorded on the CPU; its batch of 3 runs as 4 rows); and with
    the reset's prompt pairs in passes of 2 (three passes, the last one padded)."""
    if pair_pass is not None:
        monkeypatch.setattr(eagle_module, "PAIR_PASS", pair_pass[0])
        monkeypatch.setattr(eagle_module, "PAIR_ROUND", pair_pass[1])
    torch.manual_seed(0)
    head = EagleHead(256, num_heads=4)
    dec = SpecDecoder(TINY, None, drafter=EagleDrafter(head),
                      config=dict(dtype="float64", max_new_tokens=24, num_draft_tokens=6, max_depth=3, top_k=2,
                                  stop_at_eos=False, engine=dict(cuda_graphs=graphs)))
    prompts = [[5, 9, 31, 7, 5, 9, 31], [12, 40], [3]]
    dec.engine.adapter.prefill(prompts)
    dr = dec.drafter
    dr.reset(prompts)
    assert dr.cache_len.tolist() == [5, 0, 0]
    result = dec.generate(prompts)
    assert dr.cache_len.shape[0] == (len(prompts) if graphs == "off" else 4)  # no row was dropped
    for b, (p, out) in enumerate(zip(prompts, result.outputs)):
        seq, n = p + out, int(dr.cache_len[b])
        assert n == len(seq) - 2 + (len(p) == 1)  # every pair but the last root's
        _, feats = dec.adapter.score(torch.tensor([seq]), return_hidden=True)
        nxt = seq[1:]
        if len(p) == 1:  # no prefill: the first pair is (zeros, x_0), as the first tree was drafted from it
            feats, nxt = torch.cat([torch.zeros_like(feats[:, :1]), feats], 1), seq
        _, k, v = dr.head.qkv_heads(dr.head.pair(feats[:, :n], dec.adapter.embed(torch.tensor([nxt[:n]]))))
        torch.testing.assert_close(dr.cache_k[b, :n], k[0], rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(dr.cache_v[b, :n], v[0], rtol=1e-9, atol=1e-9)


def test_cache_capacity_is_a_power_of_two_that_only_grows():
    """So recorded CUDA graphs stay valid for batches of other prompt lengths."""
    dec = SpecDecoder(TINY, None, drafter=EagleDrafter(EagleHead(256)), config=dict(dtype="float32", max_new_tokens=40,
                                                                                  num_draft_tokens=6, max_depth=4))
    dr, ad = dec.drafter, dec.adapter
    for prompt_len, expected in ((10, 256), (300, 512), (10, 512)):
        ad.prefill([[7] * prompt_len])
        dr.reset([[7] * prompt_len])
        assert dr.capacity == expected and dr.cache_k.shape[1] == expected
        assert int(dr.cache_len[0]) == prompt_len - 2


def test_a_drafter_cache_too_large_for_memory_is_refused_with_its_size():
    """The EAGLE drafter's pair cache sized for a ``max_new_tokens`` no memory holds: a
    ConfigError naming the cache before it is allocated, the drafter's state unchanged and the
    decoder exact afterwards."""
    cfg = dict(dtype="float32", max_new_tokens=6, num_draft_tokens=4, max_depth=3)
    dec = SpecDecoder(TINY, None, drafter=str(TINY_EAGLE), config=cfg)
    prompt = [[7, 8, 9, 10, 11]]
    first = dec.generate(prompt).outputs
    dr = dec.drafter
    before = (dr.capacity, dr.cache_k)
    with pytest.raises(specla.ConfigError, match=r"the EAGLE drafter's key/value cache would take [0-9.]+ GiB"):
        dr.adapter.config = dr.adapter.config.model_copy(update=dict(max_new_tokens=2**31 - 1))
        dr.reset(prompt)
    dr.adapter.config = dr.adapter.config.model_copy(update=dict(max_new_tokens=6))
    assert (dr.capacity, dr.cache_k) == before
    assert dec.generate(prompt).outputs == first
    with pytest.raises(specla.ConfigError, match="drafter's key/value cache"):
        specla.run(TINY, prompts=prompt, drafter=str(TINY_EAGLE), config=dict(cfg, max_new_tokens=2**31 - 1))


def test_train_drafter_checks_its_options_before_reading_data(tmp_path):
    """Bad heads or stop_at fail before any data is read (the data file here does not exist),
    and --resume refuses a checkpoint written under other options, naming them."""
    from specla import DrafterError

    dec = SpecDecoder(TINY, None, config=dict(dtype="float32"))
    missing = [tmp_path / "no-such-data.jsonl"]
    with pytest.raises(DrafterError, match="num_heads 3 must be >= 0 and divide hidden_size 256"):
        train_drafter(dec.adapter, dec.tokenizer, missing, tmp_path / "x", DrafterTrainConfig(num_heads=3))
    with pytest.raises(DrafterError, match="stop_at must be >= 1"):
        train_drafter(dec.adapter, dec.tokenizer, missing, tmp_path / "x", DrafterTrainConfig(), stop_at=0)
    _train(tmp_path, "part", stop_at=3)
    cfg = DrafterTrainConfig(steps=6, batch_windows=4, window=32, max_tokens=600, distill_prompts=2,
                             distill_new_tokens=16, save_every=3, seed=1, num_heads=8)
    with pytest.raises(DrafterError, match=r"other options \(num_heads None there, 8 now\)"):
        train_drafter(dec.adapter, dec.tokenizer, missing, tmp_path / "part", cfg, resume=True)


DEV = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(DEV == "cpu" and __import__("os").environ.get("TRITON_INTERPRET") != "1",
                                  reason="Triton kernels need a GPU or TRITON_INTERPRET=1")


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_draft_level_on_the_kernels_equals_the_pytorch_level(dtype):
    """``EagleHead.step`` with ``kernels=True`` (one launch each for the attention, the norms and
    SwiGLU, residuals inside the GEMMs, into the pairs' own buffer) against the PyTorch level on fresh random inputs: same
    features, keys and values (float32: to rounding; bfloat16: to a few bf16 ulps of the
    features' scale), with a ragged cache (one row empty) and two ancestors per node."""
    dev = DEV
    g = torch.Generator().manual_seed(3)
    head = EagleHead(64, num_heads=4)
    with torch.no_grad():
        for prm in head.parameters():
            prm.copy_(torch.randn(prm.shape, generator=g) * prm.shape[-1] ** -0.5)
    head = head.to(dev, dtype)
    B, M, A, L = 2, 3, 2, 70
    h = torch.randn(B, M, 64, generator=g).to(dev, dtype)
    anc_k, anc_v = (torch.randn(B, M, A, 4, 16, generator=g).to(dev, dtype) for _ in range(2))
    ck, cv = (torch.randn(B, L, 4, 16, generator=g).to(dev, dtype) for _ in range(2))
    n = torch.tensor([0, 57], device=dev)
    with torch.no_grad():
        want = head.step(h, anc_k, anc_v, ck, cv, n)
        buffer = h.clone()
        got = head.step(buffer, anc_k, anc_v, ck, cv, n, kernels=True)
    assert got[0].data_ptr() == buffer.data_ptr()  # the residual GEMMs write in place: no copy of h
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=0.05, atol=0.05)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a.float(), b.float(), **tol)


@needs_triton
def test_the_trained_drafter_on_the_kernels_is_exact_and_proposes_the_same_trees():
    """The shipped tiny drafter with the Triton draft levels (float32; the target on its
    PyTorch path, which other tests cover on the kernels): greedy output equal to plain decoding,
    and the acceptance histogram of the PyTorch levels (the same trees, up to float32 rounding).
    A drafter takes the kernels exactly when its target does (``kernels="triton"``)."""
    cfg = dict(dtype="float32", max_new_tokens=12, num_draft_tokens=8, max_depth=4, top_k=3, device=DEV)
    fixed = dict(budget_policy="fixed")
    prompts = ["Question: Tom has 3 apples and buys 5 more. How many apples does he have?\nAnswer:", "def add(a, b):"]
    assert SpecDecoder(TINY, None, drafter=str(TINY_EAGLE),
                       config=dict(cfg, engine=dict(fixed, kernels="triton"))).drafter.kernels
    runs = {}
    for kernels in (False, True):
        dec = SpecDecoder(TINY, None, drafter=str(TINY_EAGLE),
                          config=dict(cfg, engine=dict(fixed, kernels="reference")))
        assert dec.drafter.kernels is False
        dec.drafter.kernels = kernels
        runs[kernels] = dec.generate(prompts)
    ar = SpecDecoder(TINY, None, config=dict(cfg, num_draft_tokens=0)).generate(prompts)
    assert runs[True].outputs == ar.outputs == runs[False].outputs
    assert runs[True].stats.accepted_histogram == runs[False].stats.accepted_histogram
    assert runs[True].stats.mean_accepted_tokens > 0


@needs_triton
def test_the_kernel_level_follows_weights_changed_in_place():
    """The stacked gate/up weight of the kernel path is refreshed when the head's weights change
    in place (``load_state_dict``), into the same buffer: both paths agree before and after."""
    torch.manual_seed(1)
    head = EagleHead(64, num_heads=1).eval().to(DEV)
    h, attended = torch.randn(2, 3, 64, device=DEV), torch.randn(2, 3, 1, 64, device=DEV)
    with torch.no_grad():
        torch.testing.assert_close(head.finish(h.clone(), attended, kernels=True), head.finish(h, attended))
        buffer = head._gate_up()
        head.load_state_dict(EagleHead(64, num_heads=1).state_dict())
        torch.testing.assert_close(head.finish(h.clone(), attended, kernels=True), head.finish(h, attended))
        assert head._gate_up() is buffer


class _RunsCode:
    """Pickles as a call of ``pathlib.Path.touch``: loading the pickle with ``weights_only=False``
    would create the marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import pathlib

        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def test_resume_refuses_a_checkpoint_that_would_run_code(tmp_path):
    """--resume reads out/checkpoint.pt with weights_only=True: a pickle in a drafter folder
    someone else wrote is refused with a DrafterError and the code in it never runs."""
    from specla import DrafterError
    from specla.apps.train_drafter import check_output

    out, marker = tmp_path / "drafter", tmp_path / "ran"
    out.mkdir()
    torch.save({"step": 1, "payload": _RunsCode(marker)}, out / "checkpoint.pt")
    with pytest.raises(DrafterError) as err:
        check_output(out, DrafterTrainConfig(), resume=True)
    assert str(err.value) == (f"--resume: {out / 'checkpoint.pt'} holds objects other than tensors, and specla loads "
                              "no such file (loading it could run code); resume only from a checkpoint.pt that "
                              "train-drafter wrote, or start afresh with --overwrite")
    assert not marker.exists()
    torch.load(out / "checkpoint.pt", weights_only=False)  # the file does run code when unpickled as before
    assert marker.exists()
