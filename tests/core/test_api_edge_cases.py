"""The engine, the public API and the options at their edges: trusted trees out of topological
order or padded past the budget, one decoder shared by threads, vanishing temperatures, plugin
detection, prompts as tensors and token ids of the wrong type, option bounds, a sampling drafter's
``q``, corrupt checkpoints and checkpoints loaded from several threads at once. Each test asserts
the exact output, error type or message."""

import copy
import threading

import numpy as np
import pytest
import torch

import specla
from specla import DraftTree, SpecConfig
from specla.api import SpecDecoder
from specla.errors import ConfigError, InvalidTokenError, InvalidTreeError, SpecError
from specla.interfaces import Drafter
from specla.registry import get_plugin
from specla_fla.plugin import TINY_TARGET

PROMPT = [55, 60, 54, 3, 5]


@pytest.fixture(scope="module")
def gdn():
    arch = get_plugin("gdn")
    model = arch.tiny_model("base", seed=8, dtype=torch.float32)
    return arch, model


class _Scripted(Drafter):
    """Proposes, for a batch of one, the next ``n`` tokens of a known greedy continuation as a
    trusted tree built by ``layout(tokens) -> (tokens, parents, num_nodes)``."""

    name = "scripted"

    def __init__(self, prompt, continuation, n, layout):
        self.prompt, self.ref, self.n, self.layout = prompt, continuation, n, layout

    def propose(self, contexts, config):
        pos = len(contexts[0]) - len(self.prompt)
        return self.layout(self.ref[pos : pos + self.n])


def _child_before_parent(toks):
    """The right chain x -> y -> z stored as [z, x, y]: parent of z (node 0) is y (node 2)."""
    if len(toks) < 3:
        return DraftTree.empty(1)
    x, y, z = toks
    return DraftTree.trusted(torch.tensor([[z, x, y]]), torch.tensor([[2, -1, 1]]), torch.tensor([3]))


def _placeholder_padding(toks):
    """The right first draft, then two padding columns holding the placeholder id -1."""
    return DraftTree.trusted(torch.tensor([[toks[0], -1, -1]]), torch.tensor([[-1, -1, -1]]), torch.tensor([1]))


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
STEPS = [("cpu", "off"), ("cpu", "unrecorded"), pytest.param("cuda", "off", marks=cuda),
         pytest.param("cuda", "on", marks=cuda)]


def _run_scripted(gdn, n, layout, device, graphs):
    """16 tokens of PROMPT with a :class:`_Scripted` drafter of ``n`` drafts per step; returns
    ``(reference continuation, run result)``."""
    arch, model = gdn
    ref = arch.reference_decode(model, PROMPT, 24)
    # fixed: the adaptive policy may run plain steps on a GPU
    cfg = dict(max_new_tokens=16, num_draft_tokens=3, max_depth=3, device=device,
               engine=dict(cuda_graphs=graphs, budget_policy="fixed"))
    return ref, specla.run(model, "gdn", prompts=[PROMPT], drafter=_Scripted(PROMPT, ref, n, layout), config=cfg)


@pytest.mark.parametrize("device,graphs", STEPS)
def test_a_trusted_tree_out_of_topological_order_is_refused_by_both_steps(gdn, device, graphs):
    with pytest.raises(InvalidTreeError, match=r"sequence 0, node 0: parent 2 is not in -1\.\.-1; nodes must be "
                                               r"in topological order"):
        _run_scripted(gdn, 3, _child_before_parent, device, graphs)


@pytest.mark.parametrize("device,graphs", STEPS)
def test_placeholder_ids_in_trusted_padding_never_reach_the_embedding(gdn, device, graphs):
    ref, out = _run_scripted(gdn, 1, _placeholder_padding, device, graphs)
    assert out.outputs == [ref[:16]]
    assert out.stats.mean_accepted_tokens == 1.0  # every step accepted its one right draft


def test_one_decoder_shared_by_threads_gives_each_call_its_own_output(gdn):
    """Eight threads, batch sizes 1 to 4, started together on one decoder: each gets exactly the
    output the same call gives alone."""
    arch, model = gdn
    dec = SpecDecoder(model, "gdn", config=dict(max_new_tokens=12, num_draft_tokens=4, max_depth=4))
    g = torch.Generator().manual_seed(4)
    requests = [[torch.randint(0, 61, (int(n),), generator=g).tolist() for n in torch.randint(1, 9, (b,), generator=g)]
                for b in (1, 2, 3, 4, 2, 1, 4, 3)]
    alone = [dec.generate(r).outputs for r in requests]
    got: list = [None] * len(requests)
    start = threading.Barrier(len(requests))

    def call(i):
        start.wait()
        got[i] = dec.generate(requests[i]).outputs

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == alone
    assert [o[0] for o in alone[:1]] == [arch.reference_decode(model, requests[0][0], 12)]


def test_generate_called_from_its_own_progress_callback_is_refused_not_deadlocked(gdn):
    """The callback runs on the thread holding the decoder: calling back in would wait on itself
    forever, so it raises at once; the decoder then decodes as before."""
    arch, model = gdn
    dec = SpecDecoder(model, "gdn", config=dict(max_new_tokens=6))

    def reenter(stats):
        dec.generate([PROMPT])

    with pytest.raises(SpecError) as err:
        dec.generate([PROMPT], progress=reenter)
    assert str(err.value) == ("generate was called from inside its own progress callback; the running call holds "
                              "the decoder until it returns: call generate again after it")
    assert dec.generate([PROMPT]).outputs == [arch.reference_decode(model, PROMPT, 6)]


@pytest.mark.parametrize("temperature", [1e-40, 1e-300, 5e-324])
def test_a_vanishing_temperature_samples_the_greedy_tokens(gdn, temperature):
    """``softmax(logits / T)`` for ``T`` down to the smallest positive float is the one-hot
    argmax (no ``inf - inf``): sampling gives the greedy output exactly."""
    from specla.acceptance import sampling_probs

    arch, model = gdn
    logits = torch.tensor([[2.0, 5.0, -1.0, 5.0 - 1e-3]])
    assert sampling_probs(logits, temperature).tolist() == [[0.0, 1.0, 0.0, 0.0]]
    assert sampling_probs(torch.tensor([[1.0, 1.0, 0.0]]), temperature).tolist() == [[0.5, 0.5, 0.0]]
    out = specla.run(model, "gdn", prompts=[PROMPT], config=dict(max_new_tokens=12, temperature=temperature, seed=1))
    assert out.outputs == [arch.reference_decode(model, PROMPT, 12)]


@pytest.mark.parametrize("name", ["gla", "mamba2"])
def test_run_detects_the_plugin_by_default(name):
    """``specla.run(model, prompts=...)`` detects the plugin from ``config.model_type``, as the
    command line does."""
    arch = get_plugin(name)
    model = arch.tiny_model(arch.tiny_variants[0], seed=1, dtype=torch.float32)
    out = specla.run(model, prompts=[[1, 2, 3, 1, 2]], config=dict(max_new_tokens=8))
    assert out.outputs == [arch.reference_decode(model, [1, 2, 3, 1, 2], 8)]


def test_prompts_as_tensors_and_tokenizer_output(gdn):
    """A ``[B, T]`` integer tensor (every row a prompt) and a tokenizer's output (padding dropped
    by its attention mask) decode like the same prompts given as lists."""
    arch, model = gdn
    dec = SpecDecoder(model, config=dict(max_new_tokens=6))
    lists = [[5, 9, 31, 7], [12, 40, 3, 8]]
    want = [arch.reference_decode(model, p, 6) for p in lists]
    assert dec.generate(torch.tensor(lists)).outputs == want
    assert dec.generate(torch.tensor(lists).numpy()).outputs == want
    padded = {"input_ids": torch.tensor([[0, 0, 5, 9, 31, 7], [12, 40, 3, 8, 0, 0]]),
              "attention_mask": torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])}
    assert dec.generate(padded).outputs == want
    with pytest.raises(TypeError, match=r"a tensor of prompts must be \[B, T\] token ids, got shape \(4,\)"):
        dec.generate(torch.tensor(lists[0]))
    assert dec.generate([[torch.tensor(t) for t in p] for p in lists]).outputs == want  # 0-d tensors


@pytest.mark.parametrize("prompts,message", [
    ([[1, 2.0, 3]], "prompt 0, position 1: token ids must be integers, got float 2.0"),
    ([[1, 2], [True, 3]], "prompt 1, position 0: token ids must be integers, got bool True"),
    ([[1, "7"]], "prompt 0, position 1: token ids must be integers, got str '7'"),
    (torch.tensor([[1.0, 2.0]]), "token ids must be integers, got a tensor of torch.float32"),
    ([torch.tensor([True, False])], "token ids must be integers, got a tensor of torch.bool"),
    (np.array([[1.0, 2.0]]), "token ids must be integers, got a numpy array of float64"),
    ([np.array([1.0, 2.0])], "token ids must be integers, got a numpy array of float64"),
])
def test_non_integer_token_ids_are_reported_as_the_wrong_type(gdn, prompts, message):
    _, model = gdn
    dec = SpecDecoder(model, config=dict(max_new_tokens=4))
    with pytest.raises(specla.TokenTypeError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        dec.generate(prompts)
    assert isinstance(err.value, TypeError) and isinstance(err.value, InvalidTokenError)


def test_option_bounds_are_checked_when_the_decoder_is_built(gdn):
    """A seed past what ``torch.Generator`` takes, draft budgets past the kernels' bound and stop
    tokens outside the vocabulary are refused by name, before anything runs."""
    import pydantic

    _, model = gdn
    with pytest.raises(pydantic.ValidationError, match="seed\n  Input should be less than 18446744073709551616"):
        SpecConfig(seed=2**70)
    assert SpecConfig(seed=2**64 - 1).seed == 2**64 - 1
    for field in ("num_draft_tokens", "max_depth"):
        with pytest.raises(pydantic.ValidationError, match=f"{field}\n  Input should be less than or equal to 64"):
            SpecConfig(**{field: 1024})
    with pytest.raises(ConfigError, match=r"stop_token_ids \[61, 99\] are outside the model's vocabulary 0\.\.60"):
        SpecDecoder(model, config=dict(stop_token_ids=(3, 61, 99)))


class _Sampling(Drafter):
    """Drafts token 1 under every node budget with a given ``q`` (a sampling drafter's claim)."""

    name = "q"

    def __init__(self, q_row, width=2):
        self.q_row, self.width = q_row, width

    def propose(self, contexts, config):
        B, W = len(contexts), self.width
        tokens = torch.zeros(B, W, dtype=torch.int64)
        tokens[:, 0] = 1
        q = self.q_row.expand(B, W, -1).clone()
        return DraftTree.trusted(tokens, torch.full((B, W), -1), torch.ones(B, dtype=torch.int64), q)


@pytest.mark.parametrize("fill,message", [
    (0.0, "sequence 0, draft node 0: draft_probs is not a distribution that gives the node's token positive"),
    (-1.0, "sequence 0, draft node 0: draft_probs is not a distribution"),
    (float("nan"), "sequence 0, draft node 0: draft_probs is not a distribution"),
])
def test_a_sampling_drafters_q_must_be_a_distribution(gdn, fill, message):
    """Lossless acceptance divides by ``q``: an all-zero, negative or NaN ``q`` would accept every
    draft or none, silently. It is refused by name; so is a ``q`` over another vocabulary."""
    _, model = gdn
    cfg = dict(temperature=0.7, max_new_tokens=3, num_draft_tokens=2, max_depth=2, seed=0)
    with pytest.raises(InvalidTreeError, match=message):
        specla.run(model, prompts=[PROMPT], drafter=_Sampling(torch.full((61,), fill)), config=cfg)
    with pytest.raises(InvalidTreeError, match="draft_probs has 68 columns; the target's vocabulary has 61"):
        specla.run(model, prompts=[PROMPT], drafter=_Sampling(torch.full((68,), 1 / 68)), config=cfg)
    uniform = specla.run(model, prompts=[PROMPT], drafter=_Sampling(torch.full((61,), 1 / 61)), config=cfg)
    assert len(uniform.outputs[0]) == 3


@pytest.mark.parametrize("graphs", ["off", "unrecorded"])
def test_padding_columns_past_the_budget_are_dropped_before_any_work(gdn, graphs):
    """A tree with one real node padded to 2,048 columns (budget 8) decodes exactly, and verify
    sees at most the budget's width (the padding cost seconds per step when it reached verify)."""
    arch, model = gdn
    ref = arch.reference_decode(model, PROMPT, 8)

    class Wide(Drafter):
        name = "wide"

        def propose(self, contexts, config):
            B = len(contexts)
            return DraftTree.trusted(torch.ones(B, 2048, dtype=torch.int64), torch.full((B, 2048), -1),
                                     torch.ones(B, dtype=torch.int64))

    dec = SpecDecoder(model, drafter=Wide(), config=dict(max_new_tokens=8, num_draft_tokens=8, max_depth=8,
                                                         engine=dict(cuda_graphs=graphs)))
    widths, verify = [], dec.adapter._verify
    dec.adapter._verify = lambda tree: widths.append(tree.width) or verify(tree)
    assert dec.generate([PROMPT]).outputs == [ref]
    assert widths and max(widths) <= 8


def test_a_corrupt_checkpoint_is_an_unsupported_model_naming_the_directory(tmp_path):
    """A config field of the wrong type and a truncated weights file are reported as
    UnsupportedModelError naming the directory and the loader's own error."""
    import json
    import shutil

    tiny = TINY_TARGET
    bad_field, truncated = tmp_path / "field", tmp_path / "weights"
    shutil.copytree(tiny, bad_field)
    cfg = json.loads((bad_field / "config.json").read_text())
    (bad_field / "config.json").write_text(json.dumps({**cfg, "vocab_size": "abc"}))
    shutil.copytree(tiny, truncated)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 3])
    for path in (bad_field, truncated):
        with pytest.raises(specla.UnsupportedModelError, match=f"cannot load the checkpoint in {path}: "):
            SpecDecoder(path)


class _RunsCode:
    """Pickles as a call of ``pathlib.Path.touch``: unpickled without ``weights_only`` it would
    create the marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import pathlib

        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def test_a_checkpoint_whose_pickle_would_run_code_is_refused_in_one_line(tmp_path):
    """A ``pytorch_model.bin`` holding more than tensors: an UnsupportedModelError in one line
    that names the directory and why, without torch's advice to load it unsafely; the code in
    it never runs."""
    import shutil

    from specla_qwen.plugin import QwenPlugin

    ckpt, marker = tmp_path / "ckpt", tmp_path / "ran"
    ckpt.mkdir()
    shutil.copy(QwenPlugin.demo_checkpoint / "config.json", ckpt)
    torch.save({"model.embed_tokens.weight": _RunsCode(marker)}, ckpt / "pytorch_model.bin")
    with pytest.raises(specla.UnsupportedModelError) as err:
        SpecDecoder(ckpt)
    assert str(err.value) == (f"cannot load the checkpoint in {ckpt}: a pickled weights file in it holds objects "
                              "other than tensors, and specla loads no such file (loading it could run code); "
                              "convert it to safetensors where it comes from a source you trust")
    assert not marker.exists()


def test_stop_ids_and_seeds_are_integers_not_coerced():
    import pydantic

    for field, value in (("stop_token_ids", ("5",)), ("stop_token_ids", (True,)), ("seed", True), ("seed", "3")):
        with pytest.raises(pydantic.ValidationError, match=f"{field}"):
            SpecConfig(**{field: value})
    assert SpecConfig(stop_token_ids=[5, 7], seed=3).stop_token_ids == (5, 7)


def test_checkpoints_loaded_from_several_threads_at_once_decode_alike(tmp_path):
    """Eight threads start ``specla.run`` on one checkpoint directory together (transformers'
    loading is not thread-safe: a tied LM head was left on the meta device): every thread gets
    the output of a run alone."""
    import transformers

    from specla_qwen.plugin import TINY_BASE

    torch.manual_seed(0)
    cfg = transformers.Qwen3_5TextConfig(**dict(TINY_BASE, tie_word_embeddings=True))
    transformers.Qwen3_5ForCausalLM(cfg).save_pretrained(tmp_path)
    path = str(tmp_path)
    prompt, cfg = [[5, 6, 7, 5, 6]], dict(max_new_tokens=6, dtype="float32", device="cpu")
    want = specla.run(path, prompts=prompt, config=cfg).outputs
    start, got, errors = threading.Barrier(8), [None] * 8, []

    def call(i):
        start.wait()
        try:
            got[i] = specla.run(path, prompts=prompt, config=cfg).outputs
        except Exception as err:  # noqa: BLE001  (reported below with its thread)
            errors.append((i, err))

    threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and got == [want] * 8


class _Tokenizer:
    """What specla calls of a tokenizer: encoding a text, and ``decode``."""

    def __call__(self, text, **kwargs):
        return {"input_ids": [ord(c) % 61 for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


@pytest.mark.parametrize("tokenizer,name", [(42, "int"), (lambda text: text, "function"), (b"tok/", "bytes")])
def test_a_tokenizer_specla_cannot_call_is_refused_when_the_decoder_is_built(gdn, tokenizer, name):
    """Not a tokenizer directory, nor callable with ``decode``: a TypeError naming what was given,
    before anything decodes (it failed when encoding text, or after decoding a whole batch of ids)."""
    _, model = gdn
    message = f"tokenizer must be a transformers tokenizer, a tokenizer directory or None, got {name}"
    with pytest.raises(TypeError) as err:
        SpecDecoder(model, tokenizer=tokenizer)
    assert str(err.value) == message
    with pytest.raises(TypeError) as err:
        specla.run(model, prompts=[PROMPT], tokenizer=tokenizer)
    assert str(err.value) == message
    out = SpecDecoder(model, tokenizer=_Tokenizer(), config=dict(max_new_tokens=3)).generate(["hi"])
    assert out.texts == [" ".join(map(str, out.outputs[0]))]


def test_a_model_path_that_is_missing_or_a_file_is_named_so(tmp_path):
    """The API words a path that is no checkpoint directory as the command line does (one
    check, :func:`specla.hf.checkpoint_dir`)."""
    cases = [(tmp_path / "nonexistent", f"{tmp_path / 'nonexistent'} does not exist"),
             (TINY_TARGET / "config.json", f"{TINY_TARGET / 'config.json'} is a file, not a checkpoint directory"),
             (tmp_path, f"{tmp_path} is not a checkpoint directory (no config.json in it)")]
    for path, message in cases:
        for model in (path, str(path)):
            with pytest.raises(specla.UnsupportedModelError) as err:
                SpecDecoder(model)
            assert str(err.value) == message
    with pytest.raises(specla.UnsupportedModelError, match="^the model path is empty$"):
        SpecDecoder("")  # not the working directory


def test_a_hub_id_is_told_how_to_fetch_it_and_a_home_path_is_expanded(tmp_path, monkeypatch):
    """specla loads local directories: an ``owner/name`` that is none gets how to download it (one
    line); ``~/...`` is the home directory, for the API as for the command line."""
    message = ("Qwen/Qwen3.5-0.8B does not exist (if it is a Hugging Face Hub id: specla loads checkpoints from "
               "local directories; download it first, `hf download Qwen/Qwen3.5-0.8B --local-dir DIR`, or load it "
               "with transformers and pass the model)")
    with pytest.raises(specla.UnsupportedModelError) as err:
        SpecDecoder("Qwen/Qwen3.5-0.8B")
    assert str(err.value) == message
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "ckpt").symlink_to(TINY_TARGET, target_is_directory=True)
    out = SpecDecoder("~/ckpt", config=dict(max_new_tokens=2)).generate([[1, 2, 3]])
    assert len(out.outputs[0]) == 2


def test_a_config_field_of_the_wrong_type_is_reported_in_one_line(tmp_path):
    """transformers' strict config check words a field of the wrong type in two lines; the
    error that wraps it is one line, as every specla error is (docs/usage.md)."""
    import json
    import shutil

    from specla_qwen.plugin import QwenPlugin

    ckpt = tmp_path / "ckpt"
    shutil.copytree(QwenPlugin.demo_checkpoint, ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "vocab_size": "lots"}))
    with pytest.raises(specla.UnsupportedModelError) as err:
        SpecDecoder(ckpt)
    assert str(err.value) == (f"cannot load the checkpoint in {ckpt}: StrictDataclassFieldValidationError: "
                              "Validation error for field 'vocab_size': TypeError: Field 'vocab_size' expected int, "
                              "got str (value: 'lots')")


def test_a_model_is_copied_only_where_the_runs_dtype_device_or_mode_differ(gdn):
    """docs/usage.md ("Stopping and memory"): a float32 model in eval mode runs as it is on a CPU;
    a bfloat16 one runs in float32 there, and one in training mode in eval mode, each as a copy
    beside the caller's model, which is left as it was."""
    arch, model = gdn
    assert SpecDecoder(model.eval(), "gdn", config=dict(device="cpu")).adapter.placement.own_copy is False
    half = copy.deepcopy(model).to(torch.bfloat16)
    adapter = SpecDecoder(half, "gdn", config=dict(device="cpu")).adapter
    assert adapter.placement.own_copy and adapter.dtype == torch.float32
    assert next(half.parameters()).dtype == torch.bfloat16
    training = copy.deepcopy(model).train()
    assert SpecDecoder(training, "gdn", config=dict(device="cpu")).adapter.placement.own_copy and training.training
