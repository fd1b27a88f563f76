"""The method registry: what each method needs and does, decided in one place."""

import dataclasses

import pytest

from longspec_jax.methods.registry import Method, ProposerOptions
from longspec_jax.models.config import DraftKind


def test_each_method_names_its_draft_and_what_it_does():
  assert {m for m in Method if m.needs_draft} == {Method.LONGSPEC, Method.GLIDE, Method.TOKENSWIFT}
  assert {m: m.draft_kind for m in Method if m.draft_kind} == {
    Method.AUTO: DraftKind.LONGSPEC,
    Method.LONGSPEC: DraftKind.LONGSPEC,
    Method.GLIDE: DraftKind.GLIDE,
    Method.TOKENSWIFT: DraftKind.TOKENSWIFT,
  }
  assert [m for m in Method if not m.copies] == [Method.AR]
  assert {m for m in Method if m.reads_sparsely} == {Method.LONGSPEC, Method.GLIDE}
  assert [str(m) for m in Method] == [m.value for m in Method]  # (as the CLIs show them)


def test_draft_methods_default_to_the_shipped_draft_and_auto_to_none():
  assert [Method(m).draft_spec(None) for m in ("longspec", "glide", "auto", "pld", "ar")] == [
    "default",
    "default",
    None,
    None,
    None,
  ]
  assert [Method(m).draft_spec("dir") for m in ("longspec", "auto", "pld")] == ["dir", "dir", None]
  assert Method.AUTO.draft_spec("none") is None


def test_options_are_frozen():
  with pytest.raises(dataclasses.FrozenInstanceError):
    ProposerOptions().copy_tokens = 3
