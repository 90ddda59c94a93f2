"""docs/plugins.md documents every hook with its exact signature and every contract member."""

import inspect
from pathlib import Path

import pytest

from specla import hookspecs
from specla.interfaces import ArchitecturePlugin, TargetAdapter

DOC = (Path(__file__).resolve().parents[2] / "docs" / "plugins.md").read_text()


def hook_names():
    return [n for n, f in vars(hookspecs).items() if callable(f) and hasattr(f, hookspecs.PROJECT + "_spec")]


def test_there_are_hooks_to_document():
    assert hook_names() == ["specla_architectures"]


@pytest.mark.parametrize("name", hook_names())
def test_every_hook_is_documented_with_its_signature(name):
    fn = getattr(hookspecs, name)
    sig = f"{name}{inspect.signature(fn)}".replace("'", "")
    assert f"`{sig}`" in DOC, f"docs/plugins.md lacks the hook signature `{sig}`"


@pytest.mark.parametrize("cls", [ArchitecturePlugin, TargetAdapter])
def test_every_abstract_and_suite_member_is_documented(cls):
    members = set(cls.__abstractmethods__)
    if cls is ArchitecturePlugin:
        members |= {"tiny_model", "reference_decode", "capabilities", "known_failures", "tiny_variants"}
    missing = [m for m in sorted(members) if f"`{m}" not in DOC]
    assert not missing, f"docs/plugins.md does not document {cls.__name__}.{missing}"
