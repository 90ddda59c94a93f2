"""End to end: greedy speculative output is token-identical to plain autoregressive decoding.

The acceptance patterns, every model shape with the ngram drafter and ragged batches are in the
packaged conformance suite (tests/plugins/test_conformance_gdn.py); these are the GDN-specific extras."""

import pytest
import torch

import specla
from specla import NonFiniteLogitsError, SpecDecoder
from specla_fla.oracle import naive_greedy_decode
from specla_fla.plugin import TINY_TARGET
from conftest import EVERY_TOKEN, make_model, poison_logits
from specla.testing import OracleDrafter

N = 6


def reference(model, prompts, n):
    return [naive_greedy_decode(model, p, n) for p in prompts]


def test_float32_token_identical(rng):
    model = make_model("base", dtype=torch.float32, seed=3)
    prompts = [[rng.randrange(61) for _ in range(12)] * 2]
    result = specla.run(model, "gdn", prompts=prompts, config=dict(max_new_tokens=40, top_k=2))
    assert result.outputs == reference(model, prompts, 40)


def test_sequences_finish_at_different_steps_and_stop_tokens(rng):
    model = make_model("base")
    prompts = [[rng.randrange(61) for _ in range(n)] for n in (3, 10, 5)]
    refs = reference(model, prompts, 30)
    stop = refs[1][6]  # sequence 1 stops at its first occurrence of this token
    first = {b: refs[b].index(stop) if stop in refs[b] else None for b in range(3)}
    drafter = OracleDrafter(prompts, refs, "alternating", 61)
    result = specla.run(model, "gdn", prompts=prompts, drafter=drafter,
                        config=dict(max_new_tokens=30, stop_token_ids=[stop]))
    for b in range(3):
        end = 30 if first[b] is None else first[b] + 1
        assert result.outputs[b] == refs[b][:end]
    assert len({len(o) for o in result.outputs}) > 1


def test_zero_budget_is_plain_autoregressive_and_decoder_is_reusable(rng):
    model = make_model("gva")
    dec = SpecDecoder(model, "gdn", config=dict(num_draft_tokens=0, max_new_tokens=9))
    prompts = [[1, 2, 3], [4]]
    first = dec.generate(prompts)
    assert first.outputs == reference(model, prompts, 9)
    assert first.stats.steps == 9 and first.stats.mean_accepted_tokens == 0
    second = dec.generate([[7, 7, 7, 7]])
    assert second.outputs == reference(model, [[7, 7, 7, 7]], 9)


def test_stats_are_consistent(rng):
    model = make_model("base")
    motif = [rng.randrange(61) for _ in range(4)]
    result = specla.run(model, "gdn", prompts=[motif * 5], config=dict(max_new_tokens=32))
    s = result.stats
    assert s.generated_tokens == 32
    assert sum(s.accepted_histogram) == s.sequence_steps == s.steps
    # every step emits accepted + 1 tokens, the last one possibly truncated by max_new_tokens
    assert s.generated_tokens <= sum((a + 1) * n for a, n in enumerate(s.accepted_histogram))
    assert s.generated_tokens > sum((a + 1) * n for a, n in enumerate(s.accepted_histogram)) - (N + 2)
    assert s.wall_s >= s.draft_s + s.verify_s + s.commit_s > 0
    d = s.to_dict()
    assert d["tokens_per_step"] == pytest.approx(s.mean_accepted_tokens + 1)


TINY = TINY_TARGET
# on TINY their greedy outputs start [6, 7, 5, ...], [9, 8, 9, ...], [90, 15, 84, ...]
PROMPTS = [[5, 6, 7, 5, 6, 7, 5], [9, 8, 9, 8, 3], [100, 200, 300]]
@pytest.mark.parametrize("config, step, rows, value, tokens, named", [
    # prompt 0 stops at its token 7 in step 2: from step 3 on, batch row 0 is prompt 1
    (dict(num_draft_tokens=0, stop_token_ids=[7]), 3, [0], float("nan"), 7, "prompt 1"),
    (dict(num_draft_tokens=0), 1, [0, 2], float("-inf"), EVERY_TOKEN, "prompts 0, 2"),
    (dict(), 2, [1], float("inf"), 7, "prompt 1"),
    (dict(temperature=0.7, seed=1), 2, [2], float("nan"), 7, "prompt 2"),
], ids=["autoregressive-nan", "autoregressive-all-minus-inf", "greedy-inf", "sampled-nan"])
def test_nonfinite_logits_raise_naming_the_prompt_and_the_step(monkeypatch, config, step, rows, value, tokens,
                                                               named):
    """NaN or +inf logits, or -inf for every token, at one step of some prompts (autoregressive,
    speculative greedy and sampled decoding with the ngram drafter, eager): generate raises
    NonFiniteLogitsError naming those prompts and the step, where greedy decoding took the id
    the argmax landed on and sampling the last id; the next call decodes as before."""
    dec = SpecDecoder(TINY, config=dict(max_new_tokens=8, dtype="float32", **config))
    clean = dec.generate(PROMPTS).outputs
    poison_logits(monkeypatch, dec.adapter, step, rows, value, tokens)
    with pytest.raises(NonFiniteLogitsError, match=rf"^{named}: the model's logits at decode step {step} hold NaN "
                                                   r"or \+inf, or are -inf for every token: no token can be chosen "
                                                   r"from them$"):
        dec.generate(PROMPTS)
    monkeypatch.undo()
    assert dec.generate(PROMPTS).outputs == clean


def test_logits_minus_inf_for_some_tokens_decode_as_without_them(monkeypatch):
    """-inf for some tokens (masked ones) is no error: token 7, masked at every step, is never
    chosen, and prompt 0 continues with the model's second choice instead."""
    dec = SpecDecoder(TINY, config=dict(max_new_tokens=4, dtype="float32", num_draft_tokens=0))
    clean = dec.generate(PROMPTS).outputs
    lm_logits = dec.adapter.lm_logits
    monkeypatch.setattr(dec.adapter, "lm_logits", lambda h: lm_logits(h).index_fill(-1, torch.tensor([7]),
                                                                                    float("-inf")))
    masked = dec.generate(PROMPTS).outputs
    assert masked[1:] == clean[1:] and masked[0][0] == clean[0][0] == 6 and masked[0][1] != 7
