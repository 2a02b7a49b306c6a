"""The configuration reference is generated from the spec and the registry, documents every
key, and docs/config.md is the generated text."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from partialfl.cli import main
from partialfl.reference import _nested, fields, reference_markdown
from partialfl.registry import KINDS, describe_options, entries
from partialfl.spec import RunSpec

ROOT = Path(__file__).resolve().parents[1]


def _spec_classes(cls=RunSpec, seen=None):
    seen = set() if seen is None else seen
    if cls in seen:
        return seen
    seen.add(cls)
    for _, sub in _nested(cls):
        _spec_classes(sub, seen)
    return seen


def test_every_spec_key_has_a_description():
    missing = [f"{c.__name__}.{f['key']}" for c in _spec_classes() for f in fields(c)
               if not f["doc"]]
    assert not missing, missing
    assert {c.__name__ for c in _spec_classes()} >= {"RunSpec", "MethodConfig", "StageConfig",
                                                     "ServerConfig", "FinetuneConfig",
                                                     "DataSpec", "ModelSpec", "AsyncSpec"}


def test_every_component_and_option_is_documented():
    for kind in KINDS:
        for e in entries(kind):
            assert e.doc, (kind, e.name)
            for o in describe_options(e.options):
                assert o["doc"], (kind, e.name, o["name"])
                assert dataclasses.is_dataclass(e.options)


def test_the_reference_names_every_key_and_component(capsys):
    text = reference_markdown()
    for c in _spec_classes():
        for f in fields(c):
            assert f"| {f['key']} |" in text
    for kind in KINDS:
        for e in entries(kind):
            assert f"**`{e.name}`**" in text
    assert main(["reference"]) == 0
    assert capsys.readouterr().out == text


def test_docs_config_md_is_the_generated_reference():
    path = ROOT / "docs" / "config.md"
    assert path.read_text() == reference_markdown(builtin=True), (
        "docs/config.md is stale: partialfl reference > docs/config.md")
