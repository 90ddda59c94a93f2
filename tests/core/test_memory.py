"""What a dropped decoder frees: its adapter, engine, drafter, model copy, states and caches go by
reference counting alone, with Python's cyclic garbage collector off (a cycle would keep them,
a converted model copy included, until the collector happens to run)."""

import collections
import gc
import weakref

import pytest
import torch

import specla
from specla import SpecDecoder
from specla.interfaces import TargetAdapter
from specla.hf import weaken_hook_cycles
from specla.registry import get_plugin, plugin_infos
from specla_fla.plugin import TINY_TARGET

BUNDLED = [p.name for p in plugin_infos() if p.builtin]
FLOAT32 = dict(max_new_tokens=3, dtype="float32")
PROMPTS = [[1, 2, 3, 4], [5, 6]]


def tiny(name: str, **kw) -> torch.nn.Module:
    """The plugin's first tiny variant; the test is skipped where it needs FLA and FLA is missing."""
    plugin = get_plugin(name)
    try:
        return plugin.tiny_model(plugin.tiny_variants[0], **kw)
    except ModuleNotFoundError as err:
        if (err.name or "").split(".")[0] != "fla":
            raise
        pytest.skip(f"the {name} plugin's tiny model needs FLA")


def left_after_drop(make) -> tuple[list[str], dict[str, int]]:
    """Build a decoder with ``make()``, generate once, then drop it with the cyclic collector off.

    Returns:
        ``(parts still alive, {type name: count} of the objects only the cyclic collector
        frees)``; the parts: adapter, engine, drafter, the adapter's model where it is a copy
        (not the caller's), the first state tensor.
    """
    dec = make()
    dec.generate(PROMPTS)
    parts = {"adapter": dec.adapter, "engine": dec.engine, "drafter": dec.drafter}
    copy = getattr(dec.adapter, "model", None)
    if copy is not None and copy is not dec.model:
        parts["model copy"] = copy
    parts["state"] = dec.adapter._state_list()[0]
    refs = {name: weakref.ref(part) for name, part in parts.items()}
    del parts, copy
    gc.collect()
    gc.disable()
    try:
        del dec
        alive = [name for name, ref in refs.items() if ref() is not None]
        gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds unreachable stays in gc.garbage
        gc.collect()
        cyclic = dict(collections.Counter(type(o).__qualname__ for o in gc.garbage))
        return alive, cyclic
    finally:
        gc.garbage.clear()
        gc.set_debug(0)
        gc.enable()


@pytest.mark.parametrize("temperature", [0.0, 0.7])
@pytest.mark.parametrize("name", BUNDLED)
def test_a_dropped_decoder_frees_its_adapter_by_reference_counting(name, temperature):
    """Every bundled plugin's first tiny variant (float64, run in float32: a converted copy where
    the plugin runs the model's own modules), greedy and sampled."""
    model = tiny(name)
    make = lambda: SpecDecoder(model, name, config=dict(FLOAT32, temperature=temperature))  # noqa: E731
    assert left_after_drop(make) == ([], {})


@pytest.mark.parametrize("options", [dict(), dict(temperature=0.7), dict(engine=dict(cuda_graphs="unrecorded"))],
                         ids=["greedy", "sampled", "graph-step"])
def test_a_dropped_decoder_frees_its_eagle_drafter(options):
    """The trained tiny GDN target from its checkpoint directory with its EAGLE drafter; also
    through the fixed-shape step a CUDA graph records (its runner holds the adapter and drafter)."""
    eagle = str(TINY_TARGET.parent / "tiny-eagle")
    make = lambda: SpecDecoder(TINY_TARGET, "gdn", drafter=eagle, config=dict(FLOAT32, **options))  # noqa: E731
    assert left_after_drop(make) == ([], {})


def test_a_dropped_decoder_frees_the_mtp_drafter(tmp_path):
    """A Qwen3.5 checkpoint with an MTP layer, ``drafter="mtp"`` (its head holds the model's
    final norm and LM head)."""
    from transformers import AutoModelForCausalLM

    from transformers_checks import write_mtp_layer

    get_plugin("qwen").tiny_model("base", seed=3, dtype=torch.float32).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    write_mtp_layer(tmp_path, model)
    make = lambda: SpecDecoder(model, drafter="mtp", config=dict(FLOAT32, num_draft_tokens=3, max_depth=3))  # noqa: E731
    assert left_after_drop(make) == ([], {})


def test_a_model_loaded_from_a_directory_is_freed_with_its_decoder(tmp_path):
    """FLA's ``Mamba2Model`` registers its own bound ``load_hook`` (a reference cycle): the model
    the decoder loads is freed with it all the same."""
    tiny("mamba2", dtype=torch.float32).save_pretrained(tmp_path)
    make = lambda: SpecDecoder(str(tmp_path), "mamba2", config=FLOAT32)  # noqa: E731
    assert left_after_drop(make) == ([], {})


def test_run_leaves_no_adapter_behind():
    """``specla.run`` three times on a bfloat16 Qwen3.5 model (run in float32 on the CPU: each
    call makes a converted copy): no adapter outlives its call, with the cyclic collector off."""
    model = tiny("qwen", dtype=torch.bfloat16)

    def adapters() -> int:
        return sum(issubclass(type(o), TargetAdapter) for o in gc.get_objects())

    gc.collect()
    before = adapters()
    gc.disable()
    try:
        for _ in range(3):
            result = specla.run(model, prompts=[[1, 2, 3, 4]], config={"max_new_tokens": 4})
            assert len(result.outputs[0]) == 4
        assert adapters() == before
    finally:
        gc.enable()


def test_weakened_hooks_still_run_and_hold_their_module_weakly():
    """transformers' ``Mamba2Model`` renames ``embedding.*`` to ``embeddings.*`` in a
    ``load_state_dict`` pre-hook, its own bound method: after :func:`weaken_hook_cycles` the
    renaming still happens, and the model is freed by reference counting."""
    model = weaken_hook_cycles(get_plugin("mamba2_hybrid").tiny_model("mamba2"))
    state = {k.replace("embeddings.", "embedding."): torch.zeros_like(v) if "embeddings." in k else v
             for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    assert model.backbone.embeddings.weight.abs().sum().item() == 0.0
    ref = weakref.ref(model.backbone)
    gc.disable()
    try:
        del model
        assert ref() is None
    finally:
        gc.enable()
