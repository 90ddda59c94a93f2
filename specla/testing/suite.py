"""The conformance suite (docs/DESIGN.md section 7) as an un-collected base class.

A plugin proves itself with a few lines in its own test file::

    from specla.testing import PluginSuite

    class TestMyArchConformance(PluginSuite):
        plugin = "myarch"

or, without writing a file, ``pytest --pyargs specla.testing --specla-plugin=myarch`` or
``specla.testing.check_plugin("myarch")``. The plugin supplies tiny random models
(``ArchitecturePlugin.tiny_model``, ``tiny_variants``) and a sequential reference decoder
(``reference_decode``); every check goes through the public contract only (``specla.run``,
``TargetAdapter``), so it applies to any architecture. Capabilities gate the tree tests (a plugin
without ``"trees"`` must reject tree drafts with a clear error); the commit-strategy tests run
``factor``, which every plugin implements, and the ``snapshot`` and ``replay`` baselines where the
plugin runs them (elsewhere they check that it refuses them, then skip); ``known_failures`` turn
named tests into strict xfails. A failed token comparison runs the batch again step by step and names
where it first left plain decoding (:func:`specla.testing.diagnose`): the sequence, the step,
the layer and the state, and by how much.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.control import current_build_context

from ..acceptance import accept_greedy
from ..baselines import BASELINES
from ..config import SpecConfig
from ..errors import (BudgetError, ConfigError, InvalidTokenError, InvalidTreeError, SpecError,
                      UnsupportedModelError)
from ..records import PendingCommit
from ..registry import get_plugin
from ..tree import DraftTree
from .diagnosis import named_states, compare_states, diagnose, state_tolerance
from .drafters import OracleDrafter, ScriptedDrafter, path_acceptance

N = 6  # draft budget of the suite's runs


def _gap(a: torch.Tensor, b: torch.Tensor) -> str:
    """``max |d| X``: the largest elementwise difference of two tensors, for a failure message."""
    return f"max |d| {float((a - b).abs().max()):.3g}"
COMMITS = ["factor", *BASELINES]  # factor: every plugin's contract; the baselines where declared



def _plain_decoding_gap(arch, model, prompts, expected, config) -> str | None:
    """Where specla's plain decoding (no drafts) of ``prompts`` already differs from ``expected``
    (the plugin's ``reference_decode``): then the fault lies in code plain decoding runs as well
    (the model spec, a mixer's verify or commit), not in the speculation, and the message says so. ``None`` where plain decoding matches, or where the plain run itself
    raises (the caller's diagnosis then reports the failure)."""
    import specla

    cfg = config.model_dump() if isinstance(config, SpecConfig) else dict(config or {})
    for key in ("max_depth", "top_k", "tau_tree"):
        cfg.pop(key, None)
    cfg["num_draft_tokens"] = 0
    cfg.setdefault("max_new_tokens", max((len(e) for e in expected), default=1))
    try:
        plain = specla.run(model, arch.name, prompts=prompts, config=cfg).outputs
    except Exception:
        return None
    for i, (got, want) in enumerate(zip(plain, expected)):
        if got != want:
            j = next((t for t, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            return (f"specla's plain decoding (no drafts) already differs from the plugin's reference_decode "
                    f"(prompt {i}, from new token {j}: {got[j:j + 4]} against {want[j:j + 4]}): the fault is in "
                    "what plain decoding runs too (the model spec's mixers, block wiring, norms or head, or a "
                    "mixer's verify or commit), not in the speculation")
    return None

class PluginSuite:
    """Base class of a plugin's conformance tests; set :attr:`plugin` in a ``Test*`` subclass.

    Attributes:
        plugin: the registered plugin name (``None``: read ``--specla-plugin``).
    """

    plugin: str | None = None

    # ------------------------------------------------------------------ fixtures
    @pytest.fixture
    def arch(self, request):
        name = self.plugin or request.config.getoption("specla_plugin", None)
        if not name:  # a run that forgot the option must not pass
            pytest.fail("no plugin named: pass --specla-plugin=NAME", pytrace=False)
        arch = get_plugin(name)
        base = type(arch).__mro__[-2]  # ArchitecturePlugin
        missing = [m for m in ("tiny_model", "reference_decode")
                   if getattr(type(arch), m) is getattr(base, m, None)] + ([] if arch.tiny_variants else ["tiny_variants"])
        if missing:
            pytest.fail(f"plugin {name!r} cannot run the conformance suite: it does not provide "
                        f"{', '.join(missing)} (docs/plugins.md, section 2)", pytrace=False)
        tests = {n for n in dir(type(self)) if n.startswith("test_")}
        stale = [k for k in arch.known_failures if k.split("[")[0] not in tests]
        if stale:  # a typo would silently run the test as expected to pass
            pytest.fail(f"plugin {name!r} declares known failures for tests the suite does not have: {stale}",
                        pytrace=False)
        # a known failure names a test, or one parametrization of it ("test_x[replay]")
        reason = arch.known_failures.get(request.node.name) or arch.known_failures.get(request.node.originalname)
        if reason:
            request.applymarker(pytest.mark.xfail(reason=reason, strict=True))
        return arch

    @pytest.fixture
    def rng(self):
        return random.Random(1234)

    @staticmethod
    def _model(arch, variant=None, dtype=torch.float64, seed=0):
        return arch.tiny_model(variant or arch.tiny_variants[0], seed=seed, dtype=dtype)

    @staticmethod
    def _vocab(model) -> int:
        return model.get_input_embeddings().weight.shape[0]

    @staticmethod
    def _runs_commit(arch, model, commit: str) -> bool:
        """Whether the plugin runs the commit strategy ``commit`` on ``model``: ``factor`` always;
        a baseline (``snapshot``, ``replay``) where ``make_adapter`` accepts it, which it must
        otherwise refuse with a ConfigError naming it (as the mixer core does for a mixer that
        does not declare it, :func:`specla.baselines.check_baselines`)."""
        if commit == "factor":
            return True
        try:
            arch.make_adapter(model, SpecConfig(engine={"commit": commit}))
        except ConfigError as err:
            assert f"commit={commit!r}" in str(err), f"the refusal of commit={commit!r} does not name it: {err}"
            return False
        return True

    def _skip_unless_runs(self, arch, model, commit: str) -> None:
        if not self._runs_commit(arch, model, commit):
            pytest.skip(f"plugin {arch.name!r} does not run the {commit} baseline (refused with a ConfigError)")

    @staticmethod
    def _check_outputs(arch, model, prompts, outputs, expected, what: str, *, drafter="ngram", config=None,
                       diagnosed: bool = True) -> None:
        """``outputs == expected``, else an AssertionError naming ``what`` and, when
        ``diagnosed``, where a step-by-step re-run of the batch with the same drafter and config
        first left plain decoding (:func:`specla.testing.diagnose`; run only on failure)."""
        if outputs == expected:
            return
        found = "not diagnosed"
        if diagnosed:
            try:
                found = diagnose(arch, model, prompts, expected, drafter=drafter, config=config)
            except Exception as err:  # the failure is reported whatever the re-run meets
                found = f"the step-by-step re-run raised {type(err).__name__}: {err}"
        found = found or "a step-by-step re-run matched plain decoding throughout"
        plain = _plain_decoding_gap(arch, model, prompts, expected, config)
        if plain:
            raise AssertionError(f"{what}: {plain}; the step-by-step re-run: {found}")
        raise AssertionError(f"{what}: speculative output differs from plain decoding: {found}")

    # ------------------------------------------------------------------ 5. end to end
    def test_greedy_ngram_token_identical_every_variant(self, arch, rng):
        """Prompts of length 1, N, N+1 and 40 (and a repeated motif, so the ngram drafter
        drafts): speculative output == the plugin's sequential greedy decoding, every variant."""
        import specla

        assert arch.tiny_variants, f"plugin {arch.name!r} lists no tiny_variants"
        for variant in arch.tiny_variants:
            model = self._model(arch, variant)
            V = self._vocab(model)
            motif = [rng.randrange(V) for _ in range(5)]
            prompts = [motif * 4, [rng.randrange(V)], [rng.randrange(V) for _ in range(N)],
                       [rng.randrange(V) for _ in range(N + 1)], [rng.randrange(V) for _ in range(40)]]
            refs = [arch.reference_decode(model, p, 16) for p in prompts]
            for top_k in (1, 3) if "trees" in arch.capabilities else (1,):
                cfg = dict(num_draft_tokens=N, max_depth=4, top_k=top_k, max_new_tokens=16)
                out = specla.run(model, arch.name, prompts=prompts, config=cfg).outputs
                self._check_outputs(arch, model, prompts, out, refs, f"variant {variant!r}, top_k {top_k}", config=cfg)

    @pytest.mark.parametrize("commit", COMMITS)
    def test_forced_acceptance_patterns_token_identical(self, arch, rng, commit):
        """Every acceptance pattern (all, none, alternating, zero drafts right after a full accept,
        a tree whose right branch is not the first child, one sequence drafting nothing while the
        others accept everything) in a ragged batch with prompts of length 1, N, N+1, N+2, 70."""
        import specla

        model = self._model(arch)
        self._skip_unless_runs(arch, model, commit)
        V = self._vocab(model)
        prompts = [[rng.randrange(V) for _ in range(n)] for n in (1, N, N + 1, N + 2, 70)]  # 70: several prefill passes
        new = 13
        refs = [arch.reference_decode(model, p, new + N) for p in prompts]
        patterns = [p for p in OracleDrafter.PATTERNS if p != "tree" or "trees" in arch.capabilities]
        for pattern in patterns:
            drafter = OracleDrafter(prompts, refs, pattern, V)
            # fixed: every step drafts, so each pattern happens on every device
            cfg = SpecConfig(num_draft_tokens=N, max_depth=N, max_new_tokens=new,
                             engine={"commit": commit, "budget_policy": "fixed"})
            out = specla.run(model, arch.name, prompts=prompts, drafter=drafter, config=cfg)
            self._check_outputs(arch, model, prompts, out.outputs, [r[:new] for r in refs], f"pattern {pattern!r}",
                                drafter=drafter, config=cfg)
            hist = out.stats.accepted_histogram  # the pattern really happened
            if pattern == "all":
                assert out.stats.mean_accepted_tokens > N - 2
            if pattern == "none":
                assert hist[0] == out.stats.sequence_steps
            if pattern in ("alternating", "tree"):  # partial accepts: conv window after a partial path
                assert sum(hist[1:N]) > 0
            if pattern in ("zero_after_many", "mixed"):
                assert hist[0] > 0 and hist[N] > 0

    def test_ragged_batch_equals_per_sequence_runs(self, arch, rng):
        """Each sequence commits its own path whatever its neighbours do, and may stop early."""
        import specla

        model = self._model(arch)
        V = self._vocab(model)
        prompts = [[rng.randrange(V) for _ in range(n)] for n in (3, 11, 5)]
        refs = [arch.reference_decode(model, p, 24 + N) for p in prompts]
        stop = refs[1][5]
        cfg = dict(num_draft_tokens=N, max_depth=N, max_new_tokens=24, stop_token_ids=[stop])
        want = [r[: r.index(stop) + 1 if stop in r[:24] else 24] for r in refs]
        drafter = OracleDrafter(prompts, refs, "alternating", V)
        batch = specla.run(model, arch.name, prompts=prompts, config=cfg, drafter=drafter).outputs
        self._check_outputs(arch, model, prompts, batch, want, "ragged batch", drafter=drafter, config=cfg)
        for b, p in enumerate(prompts):
            drafter = OracleDrafter([p], [refs[b]], "all", V)
            alone = specla.run(model, arch.name, prompts=[p], config=cfg, drafter=drafter).outputs
            self._check_outputs(arch, model, [p], alone, want[b : b + 1], f"sequence {b} alone", drafter=drafter,
                                config=cfg)

    @staticmethod
    def _detected(arch, model) -> str | None:
        """``None`` (auto-detection) where it picks ``arch`` for ``model`` (a module or a checkpoint
        directory), else ``arch``'s name. A built-in plugin must be picked for its own models; a
        third-party one is where no built-in plugin runs its model type (docs/plugins.md,
        "When plugins disagree")."""
        from ..registry import detect_plugin, plugin_infos

        builtin = {i.name for i in plugin_infos() if i.builtin}
        try:
            detected = detect_plugin(model)
        except UnsupportedModelError:
            detected = None
        if detected is arch:
            return None
        assert arch.name not in builtin, f"auto-detection picks {getattr(detected, 'name', None)!r}, not the " \
                                         f"built-in {arch.name!r}, for its own tiny model"
        assert detected is not None and detected.name in builtin, f"auto-detection picks nothing for {arch.name!r}"
        return arch.name

    def test_a_checkpoint_directory_of_every_variant_runs_unchanged(self, arch, tmp_path):
        """Every variant's tiny model in float32, written by its ``save_pretrained`` (the
        transformers layout the plugin's ``load_model`` reads): the directory is detected as the
        plugin's (see :meth:`_detected`) and ``specla.run`` on its path decodes 10 tokens exactly
        like ``reference_decode`` of the model in memory. Skipped where the tiny model has no
        ``save_pretrained`` (no checkpoint directory to write)."""
        import specla

        prompt = [3, 1, 4, 1, 5, 9, 2, 6]
        for variant in arch.tiny_variants:
            model = self._model(arch, variant, dtype=torch.float32, seed=5)
            if not hasattr(model, "save_pretrained"):
                pytest.skip(f"{arch.name}'s tiny model ({type(model).__name__}) has no save_pretrained: "
                            "no checkpoint directory to write")
            path = str(tmp_path / variant)
            model.save_pretrained(path)
            out = specla.run(path, self._detected(arch, path), prompts=[prompt], config=dict(max_new_tokens=10))
            assert out.outputs == [arch.reference_decode(model, prompt, 10)], \
                f"variant {variant!r}: the checkpoint directory decodes unlike the model saved into it"

    def test_models_of_other_plugins_are_refused_by_name(self, arch):
        """``check_model`` refuses every tiny variant of every other installed plugin, unless it
        is of a class the plugin's own tiny models are (two plugins may run one class), with an
        UnsupportedModelError that starts "the <plugin> plugin runs ", names the class of each
        of the plugin's own tiny variants before ", got ", and then the refused model's class
        (``module.Class``). Plugins whose tiny models cannot be built here (an optional dependency
        missing: FLA for the ``gdn``, ``gla`` and ``mamba2`` plugins) are left out."""
        from ..registry import available

        own = {type(self._model(arch, v)) for v in arch.tiny_variants}
        refused = 0
        for other in [get_plugin(n) for n in available() if n != arch.name]:
            for variant in other.tiny_variants:
                try:
                    model = other.tiny_model(variant)
                except (UnsupportedModelError, ImportError):  # that plugin's optional dependency (FLA) is missing
                    break
                if type(model) in own:
                    continue
                with pytest.raises(UnsupportedModelError) as err:
                    arch.check_model(model)
                msg = str(err.value)
                runs, got = msg.split(", got ", 1) if ", got " in msg else (msg, "")
                assert runs.startswith(f"the {arch.name} plugin runs ") and all(c.__name__ in runs for c in own), \
                    (f"{other.name} {variant!r}: {msg!r} does not say which models the {arch.name} plugin runs "
                     f"({sorted(c.__name__ for c in own)})")
                assert got.startswith(f"{type(model).__module__}.{type(model).__name__}"), \
                    f"{other.name} {variant!r}: {msg!r} does not name the refused class"
                refused += 1
        if not refused:
            pytest.skip(f"no other installed plugin has tiny models for {arch.name} to refuse")

    @pytest.mark.parametrize("commit", COMMITS)
    def test_tree_drafts_around_the_prefill_passes_in_float32_token_identical(self, arch, commit):
        """Every variant in float32, one ragged batch of prompts of 1, 63, 64, 65 and 129 tokens
        (both sides of the 64-token prefill passes), drafts accepted from an oracle drafter (trees
        where the plugin runs them), the plugin found by auto-detection (``plugin=None``, see
        :meth:`_detected`): 18 new tokens per prompt equal ``reference_decode``'s, and drafts were
        accepted."""
        import specla

        trees = "trees" in arch.capabilities
        for variant in arch.tiny_variants:
            model = self._model(arch, variant, dtype=torch.float32, seed=2)
            self._skip_unless_runs(arch, model, commit)
            V = self._vocab(model)
            g = torch.Generator().manual_seed(3)
            prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (1, 63, 64, 65, 129)]
            refs = [arch.reference_decode(model, p, 18) for p in prompts]
            drafter = OracleDrafter(prompts, refs, "tree" if trees else "all", V)
            cfg = SpecConfig(max_new_tokens=18, num_draft_tokens=6, max_depth=4, top_k=2 if trees else 1,
                             engine={"commit": commit})
            out = specla.run(model, self._detected(arch, model), prompts=prompts, drafter=drafter, config=cfg)
            self._check_outputs(arch, model, prompts, out.outputs, refs, f"variant {variant!r}", drafter=drafter,
                                config=cfg)
            assert out.stats.mean_accepted_tokens > 1, variant

    @pytest.mark.parametrize("commit", COMMITS)
    def test_cuda_graph_step_token_identical_or_refused(self, arch, rng, commit):
        """The fixed-shape step :class:`specla.cuda.graph_step.GraphRunner` records, run without recording
        on the CPU (``cuda_graphs="unrecorded"``): a batch of 7 (run as 8 rows) whose sequences stop at
        different steps, so finished rows stay as dead rows and the live ones are gathered into
        smaller batches, must equal sequential greedy decoding for every acceptance pattern.
        Without the ``cuda_graphs`` capability, ``unrecorded`` must raise a ConfigError."""
        import specla
        from specla.errors import ConfigError

        model = self._model(arch)
        self._skip_unless_runs(arch, model, commit)
        V = self._vocab(model)
        if "cuda_graphs" not in arch.capabilities:
            with pytest.raises(ConfigError):
                specla.run(model, arch.name, prompts=[[1, 2]],
                           config=dict(engine={"cuda_graphs": "unrecorded", "commit": commit}))
            return
        prompts = [[rng.randrange(V) for _ in range(n)] for n in (1, 2, N, N + 1, N + 2, 9, 30)]
        new = 16
        refs = [arch.reference_decode(model, p, new + N) for p in prompts]
        stops = sorted({r[j] for r, j in zip(refs, (0, 2, 4, 7, 11))})  # ends at different steps
        ends = [min([r.index(t) + 1 for t in stops if t in r[:new]] + [new]) for r in refs]
        assert len(set(ends)) >= 3, "the stops must end sequences at different steps"
        patterns = [p for p in OracleDrafter.PATTERNS if p != "tree" or "trees" in arch.capabilities]
        for pattern in patterns:
            cfg = SpecConfig(num_draft_tokens=N, max_depth=N, max_new_tokens=new, stop_token_ids=tuple(stops),
                             engine={"commit": commit, "cuda_graphs": "unrecorded"})
            drafter = OracleDrafter(prompts, refs, pattern, V)
            out = specla.run(model, arch.name, prompts=prompts, drafter=drafter, config=cfg)
            self._check_outputs(arch, model, prompts, out.outputs, [r[:e] for r, e in zip(refs, ends)],
                                f"pattern {pattern!r}", drafter=drafter, config=cfg)

    def test_tree_drafts_supported_or_rejected_clearly(self, arch):
        """A plugin without the ``trees`` capability must refuse a branching draft with a
        SpecError rather than verify it wrongly."""
        import specla

        model = self._model(arch)
        cfg = dict(num_draft_tokens=N, max_depth=3, top_k=3, max_new_tokens=8)
        prompt = [1, 2, 3, 1, 2, 3, 1, 2]
        if "trees" in arch.capabilities:
            out = specla.run(model, arch.name, prompts=[prompt], config=cfg).outputs
            self._check_outputs(arch, model, [prompt], out, [arch.reference_decode(model, prompt, 8)], "tree drafts",
                                config=cfg)
        else:
            with pytest.raises(SpecError):
                specla.run(model, arch.name, prompts=[prompt], config=cfg)

    @staticmethod
    def _assert_float32_finite_states(adapter) -> None:
        """Every recurrent state float32 and finite; a model without one (short convolutions and
        attention only, on the mixer core) must have its whole state finite instead."""
        states = adapter.recurrent_states()
        mixers = getattr(adapter, "mixers", None)
        if mixers is not None and not any(m.recurrent for m in mixers):
            assert not states and all(torch.isfinite(t).all() for m in mixers for t in m.state() if t.is_floating_point())
        else:
            assert states and all(s.dtype == torch.float32 and torch.isfinite(s).all() for s in states)

    def test_long_generation_float32_exact_and_finite(self, arch, rng):
        """120 tokens in float32: token-identical, float32 recurrent states, all finite (a model
        of short convolutions and attention alone, LFM2's, has no recurrent state: its whole
        state must then be finite)."""
        from ..api import SpecDecoder

        model = self._model(arch, dtype=torch.float32, seed=3)
        V = self._vocab(model)
        prompt = [rng.randrange(V) for _ in range(9)] * 2
        cfg = dict(max_new_tokens=120, num_draft_tokens=N, max_depth=N)
        dec = SpecDecoder(model, arch.name, config=cfg)
        self._check_outputs(arch, model, [prompt], dec.generate([prompt]).outputs,
                            [arch.reference_decode(model, prompt, 120)], "120 tokens in float32", config=cfg)
        self._assert_float32_finite_states(dec.adapter)

    # ------------------------------------------------------------------ 2-4, 7: the adapter contract
    def _adapter(self, arch, model, commit="factor", n=N):
        return arch.make_adapter(model, SpecConfig(num_draft_tokens=n, max_depth=n, engine={"commit": commit}))

    @staticmethod
    def _root_logits(adapter) -> torch.Tensor:
        """Logits of the root alone (a verify with no drafts)."""
        B = adapter.batch_size
        dev = adapter.device
        empty = DraftTree(torch.zeros(B, 0, dtype=torch.int64, device=dev), torch.zeros(B, 0, dtype=torch.int64, device=dev),
                          torch.zeros(B, dtype=torch.int64, device=dev))
        return adapter.verify(empty).logits[:, 0]

    @staticmethod
    def _mixer_adapter(arch, adapter):
        """``adapter``, which must be specla's :class:`~specla.model.adapter.ModelAdapter` for the
        checks that read its mixers' states and pending commit; else the test is skipped."""
        from ..model.adapter import ModelAdapter

        if not isinstance(adapter, ModelAdapter):
            pytest.skip(f"{arch.name}'s adapter is its own, not specla's ModelAdapter: no mixer states to read")
        return adapter

    @staticmethod
    def _snapshot(adapter) -> list[torch.Tensor]:
        """Copies of every state tensor of every mixer, in the layers' order (an adapter of the
        plugin's own: its recurrent states); a pending commit is not applied."""
        return [t.clone() for _, _, t in named_states(adapter)]

    @staticmethod
    def _differs(adapter, a: list[torch.Tensor], b: list[torch.Tensor], tol: float = 0.0) -> str:
        """The first state in which snapshot ``b`` differs from ``a`` (bit for bit, or beyond
        ``tol`` relative and absolute), named for a message: ``mixer I's 'KIND' state (max |d|
        X)``, ``I`` its mixer's index in ``adapter.mixers``; ``""`` where none does."""
        if len(a) != len(b):
            return f"the number of state tensors ({len(a)}, then {len(b)})"
        for (i, name, _), x, y in zip(named_states(adapter), a, b):
            if x.shape != y.shape:
                return f"mixer {i}'s {name!r} state (shape {list(x.shape)}, then {list(y.shape)})"
            if not (torch.allclose(x.double(), y.double(), rtol=tol, atol=tol) if tol else torch.equal(x, y)):
                return f"mixer {i}'s {name!r} state ({_gap(x.double(), y.double())})"
        return ""

    @staticmethod
    def _fixed_states(adapter) -> list[torch.Tensor]:
        """The state tensors of the mixers whose state does not grow with the sequence (recurrent
        states, conv windows): those a batch row and a run of that sequence alone hold alike."""
        return [t for m in adapter.mixers if m.recurrent for t in m.state()]

    @pytest.mark.parametrize("commit", COMMITS)
    def test_every_accepted_count_commits_exactly_the_accepted_tokens(self, arch, rng, commit):
        """Verify a chain whose first ``a`` drafts are right (a = 0..N), commit: the next logits
        equal those of a fresh adapter that prefilled exactly prompt + accepted tokens + bonus
        (state and conv window both enter the next logits)."""
        model = self._model(arch)
        self._skip_unless_runs(arch, model, commit)
        V = self._vocab(model)
        prompt = [rng.randrange(V) for _ in range(7)]
        ref = arch.reference_decode(model, prompt, N + 1)
        for a in range(N + 1):
            drafts = ref[:a] + [(t + 1) % V for t in ref[a:N]]
            adapter = self._adapter(arch, model, commit)
            adapter.prefill([prompt])
            tree = DraftTree.from_lists([(drafts, list(range(-1, N - 1)))], device=adapter.device)
            out = adapter.verify(tree)
            acc = accept_greedy(tree, out.logits)
            assert int(acc.num_accepted[0]) == a and int(acc.bonus[0]) == ref[a]
            adapter.commit(tree, out, acc)
            got = self._root_logits(adapter)  # the verify applies a delayed commit
            fresh = self._adapter(arch, model, commit)
            fresh.prefill([prompt + ref[: a + 1]])
            want = self._root_logits(fresh)
            tol = arch.logits_tolerance
            if not torch.allclose(got, want, rtol=tol, atol=tol):
                state = (compare_states(adapter, fresh, state_tolerance(arch, adapter.dtype))
                         or "every state equals plain decoding's")
                raise AssertionError(f"a = {a}: after committing {a} accepted drafts the next logits differ from a "
                                     f"fresh prefill's of the same tokens by {_gap(got, want)}; "
                                     f"{state}")

    def test_empty_commit_lays_out_what_a_step_leaves_and_changes_nothing(self, arch, rng):
        """Just after a prefill, ``empty_commit(N, D)`` (what lets a CUDA graph be recorded
        before the first step) makes ``graph_state()`` list tensors of exactly the shapes and
        dtypes a fixed-shape step of that budget leaves (trees padded to ``N``, paths to ``D``),
        for every tiny variant; committing that empty commit leaves every recurrent state
        bit-identical. Adapters of a plugin's own (not specla's ``ModelAdapter``: no graph state)
        pass."""
        self.check_empty_commit(arch, rng)

    @classmethod
    def check_empty_commit(cls, arch, rng, **config) -> None:
        """The check of :meth:`test_empty_commit_lays_out_what_a_step_leaves_and_changes_nothing`
        with extra :class:`SpecConfig` options (``engine={"kernels": "triton"}``, say)."""
        from ..model.adapter import ModelAdapter

        D = 3
        for variant in arch.tiny_variants:
            model = cls._model(arch, variant)
            V = cls._vocab(model)
            adapter = arch.make_adapter(model, SpecConfig(num_draft_tokens=N, max_depth=D, **config))
            if not isinstance(adapter, ModelAdapter):  # an adapter of the plugin's own: no graph state
                return
            prompts = [[rng.randrange(V) for _ in range(9)], [rng.randrange(V) for _ in range(4)]]
            adapter.prefill(prompts)
            before = [t.clone() for t in adapter.recurrent_states()]
            adapter.empty_commit(N, D)
            layout = [(tuple(t.shape), t.dtype) for t in adapter.graph_state()]
            after = adapter.recurrent_states()  # applies the empty commit
            assert all(torch.equal(a, b) for a, b in zip(before, after)), f"{variant}: an empty commit changed a state"
            wide = [-1, 0, 1, -1, 3, -1][:N]  # N nodes, D deep: the padded width a graph verifies
            tree = DraftTree.from_lists([([rng.randrange(V) for _ in range(N)], wide),
                                         ([rng.randrange(V)] * 2, [-1, -1])], device=adapter.device)
            adapter.static_shapes = True
            try:
                out = adapter.verify(tree)
                adapter.commit(tree, out, accept_greedy(tree, out.logits, max_depth=D))
            finally:
                adapter.static_shapes = False
            stepped = [(tuple(t.shape), t.dtype) for t in adapter.graph_state()]
            assert layout == stepped, f"{variant}: empty_commit lays out {layout}, a step leaves {stepped}"

    def test_a_one_token_prompt_beside_longer_ones_leaves_an_exactly_empty_state(self, arch, rng):
        """A one-token prompt is only the next root: in a batch beside a prompt of 39 tokens
        (first) or of 150 (second, several prefill passes), every recurrent state and conv window
        of its row is exactly zero after the prefill, on every variant."""
        checked = False
        for variant in arch.tiny_variants:
            model = self._model(arch, variant)
            V = self._vocab(model)
            long = [rng.randrange(V) for _ in range(150)]
            for prompts, row in (([[1], long[:39]], 0), ([long, [5]], 1)):
                adapter = self._mixer_adapter(arch, self._adapter(arch, model))
                adapter.prefill(prompts)
                states = self._fixed_states(adapter)
                checked = checked or bool(states)
                assert all(not t[row].any() for t in states), \
                    f"{variant}: the state of the one-token prompt {row} is not empty"
        if not checked:
            pytest.skip(f"{arch.name}'s models have no recurrent mixer")

    def test_verify_never_writes_the_state(self, arch, rng):
        """Verifying the same tree twice gives bit-identical logits."""
        model = self._model(arch)
        V = self._vocab(model)
        adapter = self._adapter(arch, model)
        adapter.prefill([[rng.randrange(V) for _ in range(9)], [rng.randrange(V)]])
        tree = DraftTree.from_lists([([1, 2, 3], [-1, 0, 1]), ([4], [-1])], device=adapter.device)
        first = adapter.verify(tree).logits
        state = self._snapshot(adapter)
        again = adapter.verify(tree).logits
        changed = self._differs(adapter, state, self._snapshot(adapter))
        assert not changed, f"verifying the same tree again changed {changed}"
        assert torch.equal(again, first), \
            f"verifying the same tree twice gave logits apart by {_gap(again, first)}"

    def test_delayed_commit_equals_flushed_and_flush_is_idempotent(self, arch, rng):
        model = self._model(arch)
        V = self._vocab(model)
        prompt = [rng.randrange(V) for _ in range(8)]
        ref = arch.reference_decode(model, prompt, N + 2)
        runs, adapters = [], []
        for flushes in (0, 1, 2):
            adapter = self._adapter(arch, model)
            adapter.prefill([prompt])
            tree = DraftTree.from_lists([(ref[:3] + [(ref[3] + 1) % V], [-1, 0, 1, 2])], device=adapter.device)
            out = adapter.verify(tree)
            adapter.commit(tree, out, accept_greedy(tree, out.logits))
            for _ in range(flushes):
                adapter.flush()
            runs.append(self._root_logits(adapter))  # the verify applies a delayed commit
            adapters.append(adapter)
        tol = arch.logits_tolerance / 10
        states = [self._snapshot(a) for a in adapters]
        assert torch.allclose(runs[0], runs[1], rtol=tol, atol=tol), (
            f"the next logits after a delayed commit and after a flushed one differ by "
            f"{_gap(runs[0], runs[1])} (tolerance {tol:.3g}); first beyond it: "
            f"{self._differs(adapters[0], states[0], states[1], tol) or 'no state'}")
        assert torch.equal(runs[1], runs[2]), (
            f"a second flush changed the next logits by {_gap(runs[1], runs[2])} "
            f"and {self._differs(adapters[1], states[1], states[2]) or 'no state'}")

    def test_bad_input_raises_by_name_and_leaves_the_state_untouched(self, arch, rng):
        """Bad trees (over the node budget, ids out of the vocabulary or negative, a parent after
        its child, another batch size) and bad prompts (none, an empty one, ids out of the
        vocabulary, negative or not integers) raise, by name (every variant), before anything
        changes: the state, the pending commit of the step before and the roots stay as they
        were, bit for bit, and so do the next logits."""
        model = self._model(arch)
        V = self._vocab(model)
        adapter = self._adapter(arch, model)
        adapter.prefill([[rng.randrange(V) for _ in range(6)]])
        before, state = self._root_logits(adapter), self._snapshot(adapter)
        bad_trees = {
            InvalidTokenError: [([V], [-1]), ([-1], [-1])],  # out of vocabulary, placeholder id
            InvalidTreeError: [([1, 2], [1, -1])],  # a parent after its child
        }
        for error, trees in bad_trees.items():
            for toks, parents in trees:
                with pytest.raises(error):
                    adapter.verify(DraftTree.from_lists([(toks, parents)], device=adapter.device))
        with pytest.raises(SpecError):  # over the node budget
            adapter.verify(DraftTree.from_lists([(list(range(N + 1)), list(range(-1, N)))], device=adapter.device))
        with pytest.raises(InvalidTokenError):
            adapter.prefill([[]])
        changed = self._differs(adapter, state, self._snapshot(adapter))
        assert not changed, f"a refused tree or prompt changed {changed}"
        after = self._root_logits(adapter)
        assert torch.equal(after, before), \
            f"a refused tree or prompt changed the next logits by {_gap(after, before)}"

        for variant in arch.tiny_variants:  # with a pending commit: the messages, and nothing moved, bit for bit
            self._check_bad_input_by_name(arch, self._model(arch, variant), variant)

    def _check_bad_input_by_name(self, arch, model, variant: str) -> None:
        V = self._vocab(model)
        adapter = self._mixer_adapter(arch, self._adapter(arch, model, n=8))
        adapter.prefill([[1, 2, 3]])
        t = DraftTree.from_lists([([4, 5], [-1, 0])], device=adapter.device)
        adapter.commit(t, adapter.verify(t), path_acceptance(t, [1], [9]))  # leaves a pending commit
        bad = [([([1] * 9, list(range(-1, 8)))], BudgetError, "over the budget N=8"),
               ([([1, V], [-1, 0])], InvalidTokenError, f"token id {V}"),
               ([([1, -100], [-1, 0])], InvalidTokenError, "token id -100"),
               ([([1], [-1]), ([2], [-1])], InvalidTreeError, "batch 2 != adapter batch 1")]
        for tree, error, match in bad:
            state, pending, roots = self._snapshot(adapter), adapter.pending, adapter.roots.clone()
            with pytest.raises(error, match=match):
                adapter.verify(DraftTree.from_lists(tree, device=adapter.device))
            changed = self._differs(adapter, state, self._snapshot(adapter))
            assert not changed, f"{variant}: {match}: the refused tree changed {changed}"
            assert adapter.pending is pending and torch.equal(adapter.roots, roots), f"{variant}: {match}"
        prompts = [([[1, 2], []], "prompt 1 is empty"), ([[1, V]], f"token id {V}"), ([[-1, 3]], "token id -1"),
                   ([], "no prompts"), ([[1, 2.5]], "position 1: token ids must be integers, got float 2.5")]
        adapter.flush()
        for bad_prompts, match in prompts:
            state, roots = self._snapshot(adapter), adapter.roots.clone()
            with pytest.raises(InvalidTokenError, match=match):
                adapter.prefill(bad_prompts)
            changed = self._differs(adapter, state, self._snapshot(adapter))
            assert not changed, f"{variant}: {match}: the refused prompts changed {changed}"
            assert torch.equal(adapter.roots, roots), f"{variant}: {match}"

    def test_commit_strategies_agree_and_delayed_equals_eager(self, arch):
        """Two steps (a branch accepted off the first child, then a chain) under every commit
        strategy the plugin runs, the ``factor`` commit both delayed and flushed at once, on every
        variant: the second step's logits and the final states agree within a tenth of
        ``logits_tolerance`` (absolute), delayed and eager ``factor`` states bit for bit; the
        delayed commit is pending exactly until a flush, and a second flush changes nothing."""
        trees = "trees" in arch.capabilities
        tol = arch.logits_tolerance / 10
        for variant in arch.tiny_variants:
            model = self._model(arch, variant)
            t1, t2 = ([9, 2, 6], [-1, 0, 0] if trees else [-1, 0, 1]), ([5, 3], [-1, 0])
            logits, states = {}, {}
            runs = [("factor", "factor", False), ("factor_eager", "factor", True)]
            runs += [(c, c, False) for c in BASELINES if self._runs_commit(arch, model, c)]
            for name, commit, eager in runs:
                adapter = self._mixer_adapter(arch, self._adapter(arch, model, commit))
                adapter.prefill([[3, 1, 4, 1, 5]])
                one, two = (DraftTree.from_lists(t, device=adapter.device) for t in ([t1], [t2]))
                adapter.commit(one, adapter.verify(one), path_acceptance(one, [2], [5]))
                if eager:
                    adapter.flush()
                if commit == "factor":
                    assert (adapter.pending is None) == eager, f"{variant}, {name}"
                logits[name] = adapter.verify(two).logits  # applies the pending commit first
                adapter.commit(two, adapter.verify(two), path_acceptance(two, [1], [8]))
                adapter.flush()
                once = self._snapshot(adapter)
                adapter.flush()  # idempotent
                changed = self._differs(adapter, once, self._snapshot(adapter))
                assert not changed, f"{variant}, {name}: a second flush changed {changed}"
                states[name] = once
            for name in states:
                assert float((logits[name] - logits["factor"]).abs().max()) < tol, f"{variant}, {name}"
                for a, b in zip(states[name], states["factor"], strict=True):
                    assert float((a - b).abs().max()) < tol, f"{variant}, {name}"
            changed = self._differs(adapter, states["factor"], states["factor_eager"])
            assert not changed, f"{variant}: delayed and eager factor commits differ in {changed}"  # same ops, order

    def test_ragged_batch_states_equal_per_sequence_runs_and_select_keeps_the_order(self, arch, rng):
        """A batch of prompts of 3, 8 and 1 tokens commits a path of 4 drafts, one off a second
        root, and none: every recurrent state and conv window of each row equals that of the
        sequence run alone, on every variant: within 1e-12 (absolute) where the plugin computes in
        float64 throughout (``logits_tolerance`` 1e-8 or tighter), else within its
        ``logits_tolerance`` (relative and absolute).
        ``select`` with a commit pending keeps the chosen sequences in the given order, their roots
        and their pending commit: after a flush their states equal those rows of the same batch
        kept whole, bit for bit, and the pending commit moved every recurrent mixer's state."""
        trees = "trees" in arch.capabilities
        # the same values through matmuls of other shapes: where every op runs in float64 (the
        # default logits_tolerance, 1e-8, or tighter) the rows agree to 1e-12; a plugin whose model
        # rounds to float32 inside a float64 run (a looser logits_tolerance) to that tolerance:
        # |d| < atol + rtol |y|
        rtol, atol = (0.0, 1e-12) if arch.logits_tolerance <= 1e-8 else (arch.logits_tolerance,) * 2
        for variant in arch.tiny_variants:
            model = self._model(arch, variant)
            V = self._vocab(model)
            prompts = [[rng.randrange(V) for _ in range(n)] for n in (3, 8, 1)]
            lists = [([1, 2, 3, 4], [-1, 0, 1, 2]), ([5, 6, 7], [-1, -1, 0] if trees else [-1, 0, 1]), ([], [])]
            ends = [3, 2, -1]

            def one_step(prompts, lists, ends, bonus):
                adapter = self._mixer_adapter(arch, self._adapter(arch, model))
                adapter.prefill(prompts)
                tree = DraftTree.from_lists(lists, device=adapter.device)
                adapter.commit(tree, adapter.verify(tree), path_acceptance(tree, ends, bonus))
                return adapter, tree

            batch, tree = one_step(prompts, lists, ends, [1, 2, 3])
            batch.flush()
            for b in range(3):
                single, _ = one_step([prompts[b]], [lists[b]], [ends[b]], [b + 1])
                single.flush()
                for x, y in zip(self._fixed_states(single), self._fixed_states(batch), strict=True):
                    d = (x[0] - y[b]).abs()
                    assert bool((d < atol + rtol * y[b].abs()).all()), \
                        f"{variant}: sequence {b} differs by max |d| {float(d.max()):.3g}"
            twins = []
            for _ in range(2):  # the same two steps twice: one batch is kept whole
                twin, tree = one_step(prompts, lists, ends, [1, 2, 3])
                twin.commit(tree, twin.verify(tree), path_acceptance(tree, ends, [4, 5, 6]))
                twins.append(twin)
            batch, whole = twins
            before = self._snapshot(batch)
            batch.select(torch.tensor([2, 0], device=batch.device))
            assert batch.roots.tolist() == [6, 4], variant
            assert isinstance(batch.pending, PendingCommit) and batch.pending.path.shape[0] == 2, variant
            batch.flush()
            whole.flush()
            rows = torch.tensor([2, 0], device=batch.device)
            after = self._snapshot(batch)
            changed = self._differs(batch, [y[rows] for y in self._snapshot(whole)], after)
            assert not changed, f"{variant}: the selected rows differ from the batch kept whole in {changed}"
            k = 0
            for m, mixer in enumerate(batch.mixers):  # row 1 is sequence 0, whose pending commit moves it
                n = len(mixer.state())
                if mixer.recurrent:
                    assert any(not torch.equal(a[1], b[0]) for a, b in zip(after[k:k + n], before[k:k + n])), \
                        f"{variant}: the pending commit left mixer {m} as it was"
                k += n

    # ------------------------------------------------------------------ 8. precision, features
    def test_bf16_activations_keep_float32_finite_states(self, arch, rng):
        """bfloat16 weights and activations: 48 speculative tokens stay finite, every recurrent
        state stays float32 (gates and decays are never rounded into the state dtype)."""
        from ..api import SpecDecoder

        model = self._model(arch, dtype=torch.bfloat16, seed=5)
        V = self._vocab(model)
        prompt = [rng.randrange(V) for _ in range(10)]
        dec = SpecDecoder(model, arch.name, config=dict(max_new_tokens=48, num_draft_tokens=N, max_depth=N,
                                                        dtype="bfloat16"))
        out = dec.generate([prompt, prompt[:3]])
        assert [len(o) for o in out.outputs] == [48, 48]
        self._assert_float32_finite_states(dec.adapter)

    def test_features_for_feature_level_drafters_are_consistent(self, arch, rng):
        """What an EAGLE-style drafter reads: ``lm_logits(hidden)`` reproduces the verify logits,
        ``embed`` has the feature width, ``last_hidden`` is one feature per sequence."""
        model = self._model(arch)
        V = self._vocab(model)
        adapter = self._adapter(arch, model)
        adapter.prefill([[rng.randrange(V) for _ in range(9)], [rng.randrange(V) for _ in range(4)]])
        tree = DraftTree.from_lists([([1, 2, 3], [-1, 0, 0]), ([4], [-1])], device=adapter.device)
        out = adapter.verify(tree)
        assert torch.allclose(adapter.lm_logits(out.hidden), out.logits, rtol=1e-9, atol=1e-9)
        width = out.hidden.shape[-1]
        assert adapter.embed(torch.tensor([[1, 2]], device=adapter.device)).shape == (1, 2, width)
        assert adapter.last_hidden.shape == (2, width)

    def test_eagle_drafter_token_identical(self, arch, rng):
        """The EAGLE drafter (a random head: it only has to be valid, not good) through the
        plugin's features, ``prompt_hidden`` included: greedy output equals sequential decoding
        for prompts of 1 to 9 tokens stopping at different steps, eagerly and, with the
        ``cuda_graphs`` capability, with the fixed-shape (graph) step, whose drafts must be the
        eager ones (same acceptance histogram: output identity alone would hold for any
        drafter). Skipped when the adapter exposes no features."""
        import specla
        from specla.drafters.eagle import EagleDrafter, EagleHead

        model = self._model(arch)
        V = self._vocab(model)
        adapter = self._adapter(arch, model)
        try:
            width = adapter.embed(torch.zeros(1, dtype=torch.int64, device=adapter.device)).shape[-1]
        except NotImplementedError:
            pytest.skip(f"{arch.name} exposes no features to drafters")
        torch.manual_seed(rng.randrange(1000))
        head = EagleHead(width, num_heads=2 if width % 2 == 0 else 1)
        prompts = [[rng.randrange(V) for _ in range(n)] for n in (1, 2, N, N + 1, 9)]
        new = 14
        refs = [arch.reference_decode(model, p, new) for p in prompts]
        stops = sorted({r[j] for r, j in zip(refs, (1, 4, 9))})
        ends = [min([r.index(t) + 1 for t in stops if t in r] + [new]) for r in refs]
        tree = dict(num_draft_tokens=N, max_depth=3, top_k=2) if "trees" in arch.capabilities else \
            dict(num_draft_tokens=3, max_depth=3, top_k=1)
        histograms = []
        for graphs in ("off", "unrecorded") if "cuda_graphs" in arch.capabilities else ("off",):
            cfg = SpecConfig(max_new_tokens=new, stop_token_ids=tuple(stops), engine={"cuda_graphs": graphs}, **tree)
            drafter = EagleDrafter(head)
            out = specla.run(model, arch.name, prompts=prompts, drafter=drafter, config=cfg)
            self._check_outputs(arch, model, prompts, out.outputs, [r[:e] for r, e in zip(refs, ends)],
                                f"cuda_graphs={graphs}", drafter=drafter, config=cfg)
            histograms.append(out.stats.accepted_histogram)
        assert all(h == histograms[0] for h in histograms), histograms

    # ------------------------------------------------------------------ property-based fuzzing
    # derandomized: every run of the suite, a third party's too, draws the same examples (a seed
    # derived from the test, no example database); --hypothesis-seed=N draws others
    @settings(max_examples=25, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                     HealthCheck.differing_executors])  # one base class, several plugins
    @given(script=st.lists(st.lists(st.tuples(st.integers(-1, 7), st.one_of(st.just("right"), st.just("wrong"),
                                                                              st.integers(0, 3))),
                                    min_size=0, max_size=8), min_size=1, max_size=4),
           lengths=st.lists(st.integers(1, 9), min_size=1, max_size=3),
           commit=st.integers(0, len(COMMITS) - 1), budget=st.integers(0, 8),
           depth=st.integers(1, 6), variant=st.integers(0, 7), seed=st.integers(0, 1000))
    def test_fuzzed_trees_and_acceptance_match_sequential(self, arch, script, lengths, commit, budget, depth,
                                                           variant, seed):
        """Random tree shapes, budgets, depths, acceptance patterns, ragged batches, model
        variants and the commit strategies the plugin runs on each (hypothesis; a failure shrinks
        to a minimal script) against sequential decoding. Configurations a plugin refuses at
        make_adapter with UnsupportedModelError are skipped by ``assume``."""
        from ..api import SpecDecoder

        if "trees" not in arch.capabilities:  # chains only: every node hangs from the previous one
            script = [[(i - 1, kind) for i, (_, kind) in enumerate(step)] for step in script]
        model = self._model(arch, arch.tiny_variants[variant % len(arch.tiny_variants)])
        commits = [c for c in COMMITS if self._runs_commit(arch, model, c)]
        commit = commits[commit % len(commits)]
        V = self._vocab(model)
        g = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in lengths]
        refs = [arch.reference_decode(model, p, 18) for p in prompts]
        cfg = SpecConfig(num_draft_tokens=budget, max_depth=depth, max_new_tokens=10, engine={"commit": commit})
        drafter = ScriptedDrafter(prompts, refs, script, V)
        try:
            dec = SpecDecoder(model, arch.name, drafter=drafter, config=cfg)
        except UnsupportedModelError:
            assume(False)
        # shrinking re-runs failing examples: only the final, minimal one is diagnosed
        self._check_outputs(arch, model, prompts, dec.generate(prompts).outputs, [r[:10] for r in refs], "fuzzed run",
                            drafter=drafter, config=cfg, diagnosed=current_build_context().is_final)

