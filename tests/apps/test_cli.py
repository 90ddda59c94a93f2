"""The command line's options and messages: generate's sampling, stop and --config flags,
train-drafter's checks before it writes, clear errors for broken checkpoints and missing
drafters, and the demo's progress and prompt echo. In-process ``specla.apps.cli.main`` calls on the
tiny target shipped with the gdn plugin."""

import json
import re
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest

import specla
from specla import DrafterError, SpecDecoder, UnsupportedModelError
from specla.apps.cli import main, read_config_option
from specla.apps.demo import shown_prompt
from specla.apps.paths import unwritable
from specla.drafters import make_drafter
from specla.drafters.eagle import EagleHead
from specla.apps.train_drafter import DrafterTrainConfig, read_texts, train_drafter
from specla.registry import detect_plugin, get_plugin
from specla_fla.plugin import TINY_TARGET

TINY = TINY_TARGET
DATA = str(resources.files("specla.apps").joinpath("data/demo_prompts.jsonl"))
PROMPT = "def add(a, b):"
# the greedy continuation of PROMPT on TINY: [332 '\n   ', 618 ' return', 293 ' b', 201 '\n', 201, 1042 'def', ...]
GREEDY = [332, 618, 293, 201, 201, 1042, 835, 65, 68, 347, 65, 68]


def cli(capsys, *args):
    """``(exit code, stdout, stderr)`` of ``specla ARGS`` run in this process."""
    try:
        code = main([str(a) for a in args])
    except SystemExit as exc:  # argparse and main's one-line errors exit
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def generate(capsys, *args):
    """``specla generate`` on TINY (CPU); returns the final JSON line's dict and stdout."""
    code, out, err = cli(capsys, "generate", "--model", TINY, "--prompt", PROMPT, "--device", "cpu", *args)
    assert code == 0, err
    return json.loads(out.strip().splitlines()[-1]), out


def last_error(err: str) -> str:
    return err.strip().splitlines()[-1]


# generate's sampling, stop and --config flags


def test_generate_samples_from_the_command_line_as_the_api_does(capsys):
    stats, out = generate(capsys, "--temperature", "0.8", "--top-p", "0.9", "--top-k", "5", "--seed", "3",
                          "--max-new-tokens", "6")
    cfg = stats["config"]
    assert (cfg["temperature"], cfg["top_p"], cfg["sampling_top_k"], cfg["seed"], cfg["max_new_tokens"]) == (
        0.8, 0.9, 5, 3, 6)
    assert cfg["top_k"] == 1  # --top-k is sampling's; the tree keeps its default width
    api = specla.run(TINY, None, prompts=[PROMPT], config=dict(temperature=0.8, top_p=0.9, sampling_top_k=5, seed=3,
                                                               max_new_tokens=6, device="cpu"))
    assert out.split("-" * 40)[0] == api.texts[0] + "\n"


def test_an_unseeded_sampled_run_reports_the_seed_that_repeats_it(capsys):
    """Sampling without --seed draws a fresh seed in the command, not the engine, and reports it
    in the final JSON line's config (it reported null): --seed with it repeats the output. A
    greedy run draws none."""
    first, out = generate(capsys, "--temperature", "0.8", "--max-new-tokens", "8")
    seed = first["config"]["seed"]
    assert isinstance(seed, int) and 0 <= seed < 2**32
    again, out_again = generate(capsys, "--temperature", "0.8", "--max-new-tokens", "8", "--seed", seed)
    assert again["config"]["seed"] == seed and out_again.split("-" * 40)[0] == out.split("-" * 40)[0]
    assert again["config"] == first["config"]
    from_config, _ = generate(capsys, "--config", '{"temperature": 0.8}', "--max-new-tokens", "2")
    assert isinstance(from_config["config"]["seed"], int)
    greedy, _ = generate(capsys, "--max-new-tokens", "2")
    assert greedy["config"]["seed"] is None


def test_generate_flags_override_config_inline_and_from_a_file(capsys, tmp_path):
    fields = {"temperature": 0.7, "seed": 1, "max_new_tokens": 20, "top_k": 2, "num_draft_tokens": 4}
    stats, _ = generate(capsys, "--config", json.dumps(fields), "--max-new-tokens", "5", "--seed", "4")
    cfg = stats["config"]
    assert (cfg["temperature"], cfg["seed"], cfg["max_new_tokens"], cfg["top_k"], cfg["num_draft_tokens"]) == (
        0.7, 4, 5, 2, 4)
    assert stats["generated_tokens"] <= 5
    (tmp_path / "c.json").write_text(json.dumps(fields))
    stats, _ = generate(capsys, "--config", tmp_path / "c.json", "--tree-top-k", "3", "--temperature", "0")
    cfg = stats["config"]
    assert (cfg["temperature"], cfg["seed"], cfg["max_new_tokens"], cfg["top_k"]) == (0.0, 1, 20, 3)


def test_sampling_filters_without_temperature_are_refused(capsys):
    code, _, err = cli(capsys, "generate", "--model", TINY, "--prompt", PROMPT, "--top-k", "2")
    assert code == 2
    assert last_error(err) == ("specla: error: --top-k filters sampling and needs --temperature > 0 (greedy "
                               "decoding ignores it); the draft tree's children per node is --tree-top-k")
    code, _, err = cli(capsys, "generate", "--model", TINY, "--prompt", PROMPT, "--top-p", "0.9")
    assert code == 2  # the tree's width is no alternative to a nucleus: no --tree-top-k hint
    assert last_error(err) == ("specla: error: --top-p filters sampling and needs --temperature > 0 (greedy "
                               "decoding ignores it)")


def test_config_errors_name_the_flag_typed_and_config_fields_by_their_name(capsys, tmp_path):
    """A value SpecConfig refuses is named by the flag that gave it (not its field), one from
    ``--config`` by ``--config`` (and its file) and its field; pydantic's "Value error, " prefix is
    left out, its "Extra inputs are not permitted" is "unknown option"."""
    (tmp_path / "c.json").write_text('{"engine": {"bogus": 1}}')
    cases = [(["--tree-top-k", "0"], "--tree-top-k: Input should be greater than or equal to 1"),
             (["--top-k", "-1", "--temperature", "1"], "--top-k: Input should be greater than or equal to 0"),
             (["--max-new-tokens", "0"], "--max-new-tokens: Input should be greater than or equal to 1"),
             (["--stop-token-id", "-3"], "--stop-token-id: stop_token_ids must be non-negative token ids, got (-3,)"),
             (["--config", '{"top_k": 0}', "--max-depth", "0"],
              "--max-depth: Input should be greater than or equal to 1; --config top_k: Input should be greater "
              "than or equal to 1"),
             (["--config", str(tmp_path / "c.json"), "--commit", "replay"],
              f"--config {tmp_path / 'c.json'} engine.bogus: unknown option")]
    for args, message in cases:
        code, _, err = cli(capsys, "generate", "--model", TINY, "--prompt", PROMPT, "--device", "cpu", *args)
        assert (code, err) == (2, f"specla: error: {message}\n"), args
    code, _, err = cli(capsys, "bench", "--model", TINY, "--prompts", tmp_path / "p.jsonl", "--max-new-tokens", "3",
                       "--config", '{"stop_token_ids": [-1]}')
    assert (code, err) == (2, "specla: error: --config stop_token_ids: stop_token_ids must be non-negative token "
                              "ids, got (-1,)\n")


def test_argument_errors_are_one_line_without_the_usage_block(capsys):
    cases = [(["generate", "--model", TINY, "--prompt", PROMPT, "--threads", "0"],
              "specla generate: error: argument --threads: must be >= 1, got 0 (see specla generate --help)"),
             (["generate", "--model", TINY, "--prompt", PROMPT, "--max-new-tokens", "abc"],
              "specla generate: error: argument --max-new-tokens: not an integer: 'abc' (see specla generate --help)"),
             (["bench", "--model", TINY, "--prompts", "p.jsonl", "--batch-size", "0"],
              "specla bench: error: argument --batch-size: must be >= 1, got 0 (see specla bench --help)"),
             ([], "specla: error: the following arguments are required: command (see specla --help)")]
    for args, line in cases:
        assert cli(capsys, *args) == (2, "", line + "\n"), args


def test_a_subcommands_unknown_arguments_are_reported_by_that_subcommand(capsys):
    """argparse leaves a subcommand's unknown arguments to the top-level parser, which named
    ``specla`` and its --help; the subcommand reports them itself. Unknown arguments before the
    subcommand stay the top level's."""
    cases = [(["generate", "--model", TINY, "--prompt", PROMPT, "--bogus-flag"],
              "specla generate: error: unrecognized arguments: --bogus-flag (see specla generate --help)"),
             (["generate", "--model", TINY, "--prompt", PROMPT, "two", "words"],
              "specla generate: error: unrecognized arguments: two words (see specla generate --help)"),
             (["plugins", "--bogus"],
              "specla plugins: error: unrecognized arguments: --bogus (see specla plugins --help)"),
             (["--bogus", "plugins"], "specla: error: unrecognized arguments: --bogus (see specla --help)")]
    for args, line in cases:
        assert cli(capsys, *args) == (2, "", line + "\n"), args


def test_stop_token_ids_and_single_token_stop_strings(capsys):
    stats, _ = generate(capsys, "--max-new-tokens", "12", "--stop-token-id", "1042")
    assert stats["generated_tokens"] == GREEDY.index(1042) + 1 and stats["config"]["stop_token_ids"] == [1042]
    stats, out = generate(capsys, "--max-new-tokens", "12", "--stop", "\n", "--stop-token-id", "618")
    assert stats["config"]["stop_token_ids"] == [618, 201]
    assert stats["generated_tokens"] == 2 and out.startswith("\n    return\n" + "-" * 40)
    stats, _ = generate(capsys, "--max-new-tokens", "12", "--stop", "\n")
    assert stats["generated_tokens"] == GREEDY.index(201) + 1 and stats["config"]["stop_token_ids"] == [201]


def test_stop_strings_of_several_tokens_are_refused(capsys):
    code, _, err = cli(capsys, "generate", "--model", TINY, "--prompt", PROMPT, "--stop", "Question: x")
    assert code == 2
    assert last_error(err) == ("specla: error: --stop 'Question: x' is 3 tokens [1666, 28, 1004] for this "
                               "tokenizer; --stop takes text that is exactly one token (pass token ids with "
                               "--stop-token-id)")


def test_generate_and_bench_share_the_config_parser(capsys, tmp_path):
    assert read_config_option('{"seed": 2}') == {"seed": 2} and read_config_option(None) == {}
    with pytest.raises(ValueError, match=r"^--config must be a JSON object of SpecConfig fields, got list$"):
        read_config_option("[1]")
    bad = tmp_path / "bad.json"
    bad.write_text("{oops")
    for command in (["generate", "--model", TINY, "--prompt", "x"], ["bench", "--model", TINY, "--prompts", DATA]):
        code, _, err = cli(capsys, *command, "--config", bad)
        assert code == 2
        assert last_error(err) == (f"specla: error: --config {bad}: not valid JSON (Expecting property name "
                                   "enclosed in double quotes: line 1 column 2 (char 1))")
        code, _, err = cli(capsys, *command, "--config", tmp_path / "none.json")
        assert code == 2
        assert last_error(err) == (f"specla: error: --config {tmp_path / 'none.json'}: no such file (inline JSON "
                                   "starts with '{')")
        code, _, err = cli(capsys, *command, "--config", tmp_path)
        assert code == 2 and last_error(err) == f"specla: error: --config {tmp_path}: is a directory"
    big = tmp_path / "big.json"
    big.write_text("{}" + " " * (1 << 20))  # valid JSON, but no config is a mebibyte
    with pytest.raises(ValueError, match=rf"^--config {re.escape(str(big))}: larger than 1 MiB, not a config$"):
        read_config_option(str(big))
    if Path("/dev/zero").exists():  # endless: refused unread, not read until memory runs out
        with pytest.raises(ValueError, match=r"^--config /dev/zero: not a regular file$"):
            read_config_option("/dev/zero")


# train-drafter


SMALL = ["--steps", "2", "--batch-windows", "2", "--window", "32", "--max-tokens", "300", "--distill-prompts", "0",
         "--device", "cpu"]


def test_train_drafter_checks_data_before_loading_and_creates_nothing(capsys, tmp_path, monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("the target was loaded before the data was checked")

    monkeypatch.setattr(specla.api, "SpecDecoder", no_load)
    out = tmp_path / "new"
    code, _, err = cli(capsys, "train-drafter", "--model", TINY, "--data", DATA, tmp_path / "missing.jsonl",
                       "--out", out, *SMALL)
    assert code == 2 and not out.exists()
    assert last_error(err) == f"specla: error: data file not found: {tmp_path / 'missing.jsonl'}"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n\n{"text": oops}\n')
    code, _, err = cli(capsys, "train-drafter", "--model", TINY, "--data", bad, "--out", out, *SMALL)
    assert code == 2 and not out.exists()
    assert last_error(err) == (f"specla: error: {bad}:3: not JSON (Expecting value: line 1 column 10 (char 9))")


def test_train_drafter_checks_that_out_can_be_written_before_loading(capsys, tmp_path, monkeypatch):
    """An --out that cannot be made (under a file; in /sys, where not even root makes folders)
    is refused by name before the target loads."""
    monkeypatch.setattr(specla.api, "SpecDecoder", lambda *a, **k: pytest.fail("the target loaded before --out"))
    plain = tmp_path / "file"
    plain.write_text("")
    code, _, err = cli(capsys, "train-drafter", "--model", TINY, "--data", DATA, "--out", plain / "d", *SMALL)
    assert code == 2
    assert last_error(err) == (f"specla: error: output folder {plain / 'd'} (--out) cannot be created or written "
                               f"({plain}: Not a directory)")
    if not Path("/sys").is_dir() or unwritable("/sys") is None:
        pytest.skip("no /sys that refuses new files")
    code, _, err = cli(capsys, "train-drafter", "--model", TINY, "--data", DATA, "--out", "/sys/specla-d", *SMALL)
    assert code == 2 and not Path("/sys/specla-d").exists()
    assert last_error(err) == ("specla: error: output folder /sys/specla-d (--out) cannot be created or written "
                               f"({unwritable('/sys')})")


def test_bad_rows_name_file_and_line(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"text": "a"}\n[1, 2]\n')
    with pytest.raises(DrafterError, match=rf"^{f}:2: row is not a JSON object$"):
        read_texts([f])
    f.write_text('{"text": "a"}\n{"prompt": 3}\n')
    with pytest.raises(DrafterError, match=rf"^{f}:2: 'text'/'prompt' must be a string, got int$"):
        read_texts([f])
    with pytest.raises(FileNotFoundError, match=rf"^data files not found: {tmp_path}/a, {tmp_path}/b$"):
        read_texts([tmp_path / "a", f, tmp_path / "b"])


def test_train_drafter_refuses_to_overwrite_a_drafter(capsys, tmp_path):
    out = tmp_path / "d"
    EagleHead(256).save(out, trained_steps=7)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    code, _, err = cli(capsys, "train-drafter", "--model", TINY, "--data", DATA, "--out", out, *SMALL)
    assert code == 2
    assert last_error(err) == (f"specla: error: output folder {out} already holds a drafter (config.json, "
                               "model.safetensors): continue its training with --resume (resume=True), replace it "
                               "with --overwrite (overwrite=True), or choose another folder")
    code, _, err = cli(capsys, "train-drafter", "--model", TINY, "--data", DATA, "--out", out, *SMALL, "--resume")
    assert code == 2 and "holds a drafter (config.json, model.safetensors) but no checkpoint.pt" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    code, _, err = cli(capsys, "train-drafter", "--model", TINY, "--data", DATA, "--out", out, *SMALL, "--resume",
                       "--overwrite")
    assert code == 2 and "argument --overwrite: not allowed with argument --resume" in err
    code, stdout, err = cli(capsys, "train-drafter", "--model", TINY, "--data", DATA, "--out", out, *SMALL,
                            "--overwrite")
    assert code == 0, err
    assert json.loads((out / "config.json").read_text())["trained_steps"] == 2
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint.pt", "config.json", "model.safetensors",
                                                     "training.json"]


def _train(tmp_path, steps, **kw):
    dec = SpecDecoder(TINY, None, config=dict(dtype="float32"))
    cfg = DrafterTrainConfig(steps=steps, batch_windows=2, window=32, max_tokens=300, distill_prompts=0, save_every=2,
                             seed=1)
    return train_drafter(dec.adapter, dec.tokenizer, [DATA], tmp_path / "d", cfg, log=lambda *_: None, **kw)


def test_resume_extends_a_finished_run_to_more_steps(tmp_path):
    _train(tmp_path, 2)
    assert json.loads((tmp_path / "d" / "config.json").read_text())["trained_steps"] == 2
    summary = _train(tmp_path, 4, resume=True)
    assert summary["config"]["steps"] == 4 and summary["log"][-1]["step"] == 3
    assert json.loads((tmp_path / "d" / "config.json").read_text())["trained_steps"] == 4
    with pytest.raises(DrafterError, match=rf"^--resume: the checkpoint in {tmp_path / 'd'} is at step 4, beyond "
                                           r"--steps 3; pass --steps 4 or more$"):
        _train(tmp_path, 3, resume=True)


def test_train_drafter_help_shows_every_default(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")  # one line per option
    code, out, _ = cli(capsys, "train-drafter", "--help")
    assert code == 0
    lines, flag = {}, None
    for line in out.splitlines():  # an option's help may start on the line after it
        if line.strip().startswith("--"):
            flag = line.split()[0]
            lines[flag] = line.rstrip()
        elif flag and line.startswith("     "):
            lines[flag] += " " + line.strip()
    expected = {"--steps": "(default: 2000)", "--batch-windows": "(default: 32)", "--window": "(default: 128)",
                "--max-tokens": "(default: 400000)", "--distill-prompts": "(default: 256)", "--lr": "(default: 0.001)",
                "--ce-weight": "(default: 1.0)", "--unroll": "(default: 3)", "--save-every": "(default: 500)",
                "--seed": "(default: 0)", "--heads": "default: hidden size / 64)",
                "--device": "(default: cuda if available)", "--plugin": "(default: detected from config.json)",
                "--stop-at": "default: run to --steps)"}
    for flag, text in expected.items():
        assert lines[flag].endswith(text), lines[flag]


# broken checkpoints, missing drafters, --tokenizer


def test_corrupt_config_json_is_an_unsupported_model_naming_the_file(capsys, tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    shutil.copy(TINY / "tokenizer.json", tmp_path)
    shutil.copy(TINY / "tokenizer_config.json", tmp_path)
    message = (f"{tmp_path / 'config.json'} is not valid JSON: Expecting property name enclosed in double quotes: "
               "line 1 column 2 (char 1)")
    with pytest.raises(UnsupportedModelError) as err:
        detect_plugin(tmp_path)
    assert str(err.value) == message
    with pytest.raises(UnsupportedModelError) as err:
        SpecDecoder(tmp_path, None)
    assert str(err.value) == message
    code, _, err = cli(capsys, "generate", "--model", tmp_path, "--prompt", "hi", "--device", "cpu")
    assert code == 2 and last_error(err) == f"specla: error: {message}"
    (tmp_path / "config.json").write_text("[1]")
    with pytest.raises(UnsupportedModelError, match=r"config.json is not a JSON object \(got list\)$"):
        detect_plugin(tmp_path)


def test_missing_drafter_directories_say_so(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("/no/such/dir", "./missing", "~/no-such-specla-drafter", "sub/missing"):
        with pytest.raises(DrafterError) as err:
            make_drafter(name)
        assert str(err.value) == f"drafter directory {name} does not exist"
    with pytest.raises(specla.UnknownPluginError, match=r"^unknown drafter 'missing'; available drafters: ngram, mtp \(a "
                                                        r"model's own: the mamba2_hybrid, qwen plugins'\), or a "
                                                        r"directory saved by `specla train-drafter`$"):
        make_drafter("missing")
    code, _, err = cli(capsys, "generate", "--model", TINY, "--prompt", "hi", "--device", "cpu", "--drafter",
                       "./missing")
    assert code == 2 and last_error(err) == "specla: error: drafter directory ./missing does not exist"


def test_a_truncated_drafter_weights_file_is_a_drafter_error_naming_it(capsys, tmp_path):
    drafter = tmp_path / "eagle"
    shutil.copytree(TINY.parent / "tiny-eagle", drafter)
    weights = drafter / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    message = (rf"{re.escape(str(weights))} cannot be read \(Error while deserializing header: [^)]+\): the drafter's "
               r"weights file is truncated or corrupt")
    with pytest.raises(DrafterError, match=f"^{message}$"):
        SpecDecoder(TINY, drafter=str(drafter), config=dict(device="cpu"))
    code, _, err = cli(capsys, "generate", "--model", TINY, "--prompt", "hi", "--device", "cpu", "--drafter", drafter)
    assert code == 2 and re.fullmatch(f"specla: error: {message}\n", err)


def test_cli_asks_for_the_tokenizer_flag(capsys, tmp_path):
    for name in ("config.json", "model.safetensors"):
        shutil.copy(TINY / name, tmp_path)
    code, _, err = cli(capsys, "generate", "--model", tmp_path, "--prompt", "hi", "--device", "cpu")
    assert code == 2
    assert last_error(err) == (f"specla: error: --model {tmp_path} has no tokenizer (no tokenizer.json in it): "
                               "pass --tokenizer DIR")
    stats, _ = generate(capsys, "--model", tmp_path, "--tokenizer", TINY, "--max-new-tokens", "3")  # the flag named
    assert stats["generated_tokens"] == 3



def test_a_tokenizer_file_or_an_empty_path_is_named_so(capsys, tmp_path):
    """``--tokenizer .../tokenizer.json`` (the file, not its directory) is refused naming the
    directory to give; an empty path is named empty, not read as the working directory."""
    shutil.copy(TINY / "tokenizer.json", tmp_path)
    file = tmp_path / "tokenizer.json"
    message = f"tokenizer directory {file} is a file: give the directory holding it ({tmp_path})"
    with pytest.raises(FileNotFoundError) as err:
        SpecDecoder(TINY, tokenizer=str(file), config=dict(device="cpu"))
    assert str(err.value) == message
    code, out, err = cli(capsys, "generate", "--model", TINY, "--prompt", "hi", "--device", "cpu", "--tokenizer", file)
    assert (code, out, err) == (2, "", f"specla: error: {message}\n")
    with pytest.raises(FileNotFoundError, match="^the tokenizer directory path is empty$"):
        SpecDecoder(TINY, tokenizer="", config=dict(device="cpu"))


def test_a_process_started_with_stdout_closed_runs_without_a_traceback(monkeypatch):
    """``specla plugins >&-``: Python's ``sys.stdout`` is None; the command still ends normally."""
    monkeypatch.setattr(sys, "stdout", None)
    assert main(["plugins"]) == 0


@pytest.mark.parametrize("files", [(), ("config.json",), ("config.json", "tokenizer_config.json")])
def test_a_tokenizer_directory_without_a_tokenizer_is_one_line_naming_it(capsys, tmp_path, monkeypatch, files):
    """A tokenizer directory with no vocabulary file is refused in one line that names it and the
    files looked for, before the checkpoint loads: transformers raises a multi-line error for an
    empty directory and builds an empty tokenizer from a checkpoint's config.json alone."""
    for name in files:
        shutil.copy(TINY / name, tmp_path)
    message = (f"tokenizer directory {tmp_path} holds no tokenizer (no tokenizer.json, vocab.*, *.model or "
               "*.tiktoken file in it)")
    monkeypatch.setattr(get_plugin("gdn"), "load_model", lambda *a, **k: pytest.fail("the checkpoint was loaded"))
    for run in (lambda: SpecDecoder(TINY, tokenizer=tmp_path, config=dict(device="cpu")),
                lambda: specla.run(TINY, prompts=["hi"], tokenizer=str(tmp_path), config=dict(device="cpu"))):
        with pytest.raises(FileNotFoundError) as err:
            run()
        assert str(err.value) == message
    for extra in ((), ("--stop", "\n")):  # --stop reads the tokenizer before the decoder is built
        code, out, err = cli(capsys, "generate", "--model", TINY, "--prompt", "hi", "--device", "cpu",
                             "--tokenizer", tmp_path, *extra)
        assert (code, out, err) == (2, "", f"specla: error: {message}\n")


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["bench", "--prompts", DATA, "--allow-dirty"]])
def test_an_unknown_drafter_name_is_one_line_listing_the_drafters(capsys, command):
    code, out, err = cli(capsys, command[0], "--model", TINY, *command[1:], "--device", "cpu", "--drafter", "nosuch")
    assert (code, out, err) == (2, "", "specla: error: unknown drafter 'nosuch'; available drafters: ngram, mtp (a "
                                       "model's own: the mamba2_hybrid, qwen plugins'), or a directory saved by "
                                       "`specla train-drafter`\n")


# the demo


def test_demo_reports_progress_on_stderr_and_ends_stdout_with_its_json(capsys):
    code, out, err = cli(capsys, "demo", "--device", "cpu", "--max-new-tokens", "4", "--progress")
    assert code == 0
    assert "demo: decoding" in err and "6/6" in err and "demo:" not in out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["prompts"] == 6 and summary["exact_match"] is True
    assert '[... 98 characters cut]\n    """ Check if in given list of numbers' in out


def test_demo_and_generate_draw_no_progress_bar_when_stderr_is_not_a_terminal(capsys):
    """Bars, transformers' "Loading weights" too, are drawn on a terminal (or with --progress);
    captured here, stderr is none."""
    code, out, err = cli(capsys, "demo", "--device", "cpu", "--max-new-tokens", "4")
    assert (code, err) == (0, "")
    assert json.loads(out.strip().splitlines()[-1])["exact_match"] is True
    code, _, err = cli(capsys, "generate", "--model", TINY, "--prompt", PROMPT, "--device", "cpu",
                       "--max-new-tokens", "300")
    assert (code, err) == (0, "")


def test_the_demo_says_its_target_ships_no_mtp_layer_when_asked_for_mtp(capsys):
    """The demo's target is a qwen model, whose own drafter ``mtp`` needs the checkpoint's MTP
    layer; the tiny checkpoint ships none. The demo says so (it said mtp needed a qwen or
    mamba2_hybrid model), in the API's words, and which drafters it runs."""
    from specla_qwen.plugin import QwenPlugin

    tiny = QwenPlugin.demo_checkpoint
    reason = (f"drafter='mtp' reads the checkpoint's mtp.* tensors, and {tiny} holds none: load the model from a "
              "checkpoint directory that ships its MTP layer")
    with pytest.raises(DrafterError) as err:
        SpecDecoder(tiny, drafter="mtp", config=dict(device="cpu"))
    assert str(err.value) == reason
    code, out, err = cli(capsys, "demo", "--drafter", "mtp", "--device", "cpu", "--no-progress")
    assert (code, out, last_error(err)) == (2, "", f"specla: error: the demo's target cannot run its own drafter "
                                                   f"'mtp' ({reason}); the demo runs ngram, eagle or a directory saved "
                                                   "by `specla train-drafter`")


def test_shown_prompt_cuts_at_a_boundary_with_a_marker():
    assert shown_prompt("short prompt\n") == "short prompt"
    assert shown_prompt("first line\nsecond line\nthird", limit=18) == "[... 11 characters cut]\nsecond line\nthird"
    # the only line start would leave 3 of 12 characters: a word start instead
    assert shown_prompt("long first line here\nend", limit=12) == "[... 16 characters cut]\nhere\nend"
    assert shown_prompt("x\nlong line here", limit=12) == "[... 7 characters cut]\nline here"  # no line start
    assert shown_prompt("aaa bbb ccc ddd", limit=6) == "[... 12 characters cut]\nddd"
    assert shown_prompt("abcdefgh", limit=3) == "[... 5 characters cut]\nfgh"  # one word: the hard limit
    with pytest.raises(ValueError, match="limit must be >= 1, got 0"):
        shown_prompt("x", limit=0)


def test_train_drafter_never_writes_into_a_model_checkpoint(tmp_path, capsys):
    """``--out`` naming a folder whose config.json is not a drafter's (here the target's own
    folder) is refused even with ``--overwrite``, and the checkpoint is left as it was."""
    target = tmp_path / "tgt"
    shutil.copytree(TINY_TARGET, target)
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": "a b c d e f g " * 40}) + "\n")
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    for flags in ([], ["--overwrite"]):
        code, _, err = cli(capsys, "train-drafter", "--model", str(target), "--data", str(data), "--out", str(target),
                           "--steps", "2", "--device", "cpu", *flags)
        assert code == 2 and f"output folder {target} holds a config.json that is not a drafter's" in err
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before


@pytest.mark.parametrize("env,device,threads", [(None, "cpu", [1]), ("2", "cpu", []), (None, "cuda", [])])
def test_the_demo_runs_torch_on_one_thread_on_a_cpu_unless_told(monkeypatch, capsys, env, device, threads):
    """``specla demo`` on a CPU sets torch to one thread unless ``OMP_NUM_THREADS`` is set; on
    a GPU it leaves torch's threads alone (the demo itself replaced by a stub here)."""
    import torch

    import specla.apps.demo

    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    monkeypatch.setattr(specla.apps.demo, "run_demo", lambda **kw: {"exact_match": True, "device": kw["device"]})
    if device == "cuda":  # the CLI checks --device before the (stubbed) demo
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    if env is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", env)
    assert main(["demo", "--device", device]) == 0
    assert calls == threads
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["device"] == device


# a closed pipe


@pytest.mark.parametrize("args,unbuffered", [(["plugins"], False), (["plugins"], True),
                                             (["generate", "--model", TINY, "--prompt", PROMPT, "--device", "cpu",
                                               "--max-new-tokens", "4"], True)])
def test_a_reader_that_closed_stdout_ends_the_command_quietly_with_141(args, unbuffered):
    """``specla generate ... | head -c 10``: once the reader is gone, the command ends as a
    process killed by SIGPIPE would (status 141, nothing on stderr), not with ``specla: error:
    [Errno 32] Broken pipe`` and 2, nor with the interpreter's complaint at exit (block-buffered
    stdout writes only then)."""
    import os

    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first write: every write fails
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env.update(PYTHONWARNINGS="ignore", **({"PYTHONUNBUFFERED": "1"} if unbuffered else {}))
    try:
        out = subprocess.run([sys.executable, "-m", "specla.apps.cli", *map(str, args)], stdout=write,
                             stderr=subprocess.PIPE, text=True, env=env, timeout=300)
    finally:
        os.close(write)
    assert (out.returncode, out.stderr) == (141, "")


# Ctrl-C and progress


def _interrupt_after(monkeypatch, steps):
    """Makes ``SpecDecoder.generate`` raise KeyboardInterrupt after ``steps`` steps, as Ctrl-C
    during decoding does; records the ``progress`` each call was given."""
    given = []
    real = SpecDecoder.generate

    def interrupted(self, prompts, progress=False):
        given.append(progress)

        def stop(stats):
            if stats.steps == steps:
                raise KeyboardInterrupt

        return real(self, prompts, progress=stop)

    monkeypatch.setattr(SpecDecoder, "generate", interrupted)
    return given


def test_ctrl_c_during_generate_prints_the_partial_output_and_exits_130(capsys, monkeypatch):
    _interrupt_after(monkeypatch, 2)
    code, out, err = cli(capsys, "generate", "--model", TINY, "--prompt", PROMPT, "--device", "cpu",
                         "--max-new-tokens", "12", "--num-draft-tokens", "0")  # one token a step
    assert code == 130 and "Traceback" not in err
    text, rule, stats = out.rstrip("\n").rsplit("\n", 2)
    tokenizer = SpecDecoder(TINY, config=dict(device="cpu")).tokenizer
    assert text == tokenizer.decode(GREEDY[:2], skip_special_tokens=True) and rule == "-" * 40
    assert json.loads(stats)["generated_tokens"] == 2
    assert err.splitlines()[-1] == "specla: interrupted: the output above is what was decoded until then (2 tokens)"


def test_ctrl_c_before_decoding_exits_130_in_one_line(capsys, monkeypatch):
    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(SpecDecoder, "__init__", interrupt)
    code, out, err = cli(capsys, "generate", "--model", TINY, "--prompt", PROMPT, "--device", "cpu")
    assert (code, out, err) == (130, "", "specla: interrupted\n")


@pytest.mark.parametrize("flags, tty, shown", [
    ([], False, False), ([], True, True), (["--max-new-tokens", "3"], True, False), (["--progress"], False, True),
    (["--no-progress"], True, False),
])
def test_generate_shows_progress_on_a_terminal_for_long_decodes_or_when_asked(capsys, monkeypatch, flags, tty,
                                                                             shown):
    """The bar appears from ``PROGRESS_FROM_TOKENS`` tokens per prompt when stderr is a
    terminal, or with ``--progress``; ``--no-progress`` hides it (decoding stopped at once here)."""
    import sys

    import specla.apps.cli

    given = _interrupt_after(monkeypatch, 1)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: tty)
    code, _, _ = cli(capsys, "generate", "--model", TINY, "--prompt", PROMPT, "--device", "cpu",
                     "--max-new-tokens", str(specla.apps.cli.PROGRESS_FROM_TOKENS), *flags)
    assert code == 130 and given == [shown]


def test_the_commands_that_decode_on_a_cpu_take_one_torch_thread_unless_told(monkeypatch, capsys):
    """``generate`` (and ``bench``, ``demo``) on a CPU set torch to one thread unless
    ``OMP_NUM_THREADS`` is set, and to ``--threads N`` when given: torch's thread per core
    oversubscribes cores that other work uses (README, "CPU threads")."""
    import torch

    import specla.apps.cli

    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    argv = ["generate", "--model", str(TINY), "--prompt", "hi", "--max-new-tokens", "2", "--device", "cpu"]
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert specla.apps.cli.main(argv) == 0 and calls == [1]
    assert specla.apps.cli.main([*argv, "--threads", "2"]) == 0 and calls == [1, 2]
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert specla.apps.cli.main(argv) == 0 and calls == [1, 2]
    assert specla.apps.cli.main([*argv, "--threads", "4"]) == 0 and calls == [1, 2, 4]
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        specla.apps.cli.main([*argv, "--threads", "0"])
    assert exit_.value.code == 2 and "--threads: must be >= 1, got 0" in capsys.readouterr().err


def test_a_deprecated_config_key_on_the_command_line_is_one_warning_line():
    """A flat engine key in ``--config`` (the previous release's spelling) still runs, with one
    ``specla: warning:`` line naming the new spelling (run in a fresh process: pytest records
    warnings instead of printing them)."""
    code = ("import specla.apps.cli\n"
            f"specla.apps.cli.main(['generate', '--model', {str(TINY)!r}, '--prompt', 'def', '--device', 'cpu', "
            "'--max-new-tokens', '2', '--config', '{\"kernels\": \"reference\"}', '--no-progress'])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = [ln for ln in out.stderr.splitlines() if "deprecated" in ln]
    assert lines == ["specla: warning: SpecConfig field 'kernels' is deprecated and will be removed in the next "
                     "release: use engine={'kernels': 'reference'}"], out.stderr


class _RunsCode:
    """Pickles as a call of ``pathlib.Path.touch``: unpickled unsafely it would create the marker."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import pathlib

        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def test_pickles_holding_more_than_tensors_are_refused_in_one_line_and_never_run(tmp_path):
    """A drafter's ``checkpoint.pt`` (--resume) and a checkpoint's ``pytorch_model.bin`` that would
    run code when unpickled, saved with pickle protocol 4 (torch warns about it): each command
    prints one line, torch's advice and warning left out, and the code never runs (run in a fresh
    process: pytest records warnings instead of printing them)."""
    import torch

    marker, out, model = tmp_path / "ran", tmp_path / "d", tmp_path / "m"
    EagleHead(256).save(out, trained_steps=7)
    torch.save({"step": 1, "payload": _RunsCode(marker)}, out / "checkpoint.pt", pickle_protocol=4)
    model.mkdir()
    shutil.copy(f"{TINY}/config.json", model)
    torch.save({"model.embed_tokens.weight": _RunsCode(marker)}, model / "pytorch_model.bin", pickle_protocol=4)
    commands = [["train-drafter", "--model", TINY, "--data", DATA, "--out", out, *SMALL, "--resume"],
                ["generate", "--model", model, "--prompt", PROMPT, "--device", "cpu", "--tokenizer", TINY]]
    errors = []
    for command in commands:
        run = subprocess.run([sys.executable, "-m", "specla.apps.cli", *map(str, command)], capture_output=True,
                             text=True, timeout=300)
        assert run.returncode == 2, run.stderr
        errors.append(run.stderr)
    unread = ("cannot be read by torch's tensors-only loader (it holds objects other than tensors, or was written "
              "with pickle protocol 4 or later), and specla loads no such file (loading it could run code)")
    assert errors == [
        f"specla: error: --resume: {out / 'checkpoint.pt'} {unread}; resume only from a checkpoint.pt that "
        "train-drafter wrote, or start afresh with --overwrite\n",
        f"specla: error: cannot load the checkpoint in {model}: a pickled weights file in it {unread}; convert it "
        "to safetensors where it comes from a source you trust\n"]
    assert not marker.exists()


def test_the_command_line_prints_speclas_warnings_in_one_line_and_leaves_others_as_they_are():
    """Run in a fresh process: pytest records warnings instead of printing them."""
    code = (
        "import warnings, specla.apps.cli, specla.registry\n"
        "from specla.errors import ContextLengthWarning\n"
        "def warn_both():\n"
        "    warnings.warn('past the trained context', ContextLengthWarning)\n"
        "    warnings.warn(\"a library's own\", UserWarning)\n"
        "    return []\n"
        "specla.registry.plugin_infos = warn_both\n"
        "before = warnings.formatwarning\n"
        "assert specla.apps.cli.main(['plugins']) == 0\n"
        "assert warnings.formatwarning is before\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    err = out.stderr.splitlines()
    assert out.returncode == 0, out.stderr
    assert err[0] == "specla: warning: past the trained context"
    assert err[1].endswith("UserWarning: a library's own") and err[1].startswith("<string>:5: ")
