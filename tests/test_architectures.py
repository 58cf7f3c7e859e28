"""The registries are one place each: no positional-kind literal outside backend/families/, one architecture table
that every list reads, and a row added or changed there reaches peek, the facts and `posprobe info`."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from posprobe.backend import architectures as A
from posprobe.backend import families as F
from posprobe.backend.peek import hf_is_encoder, hf_positional_kind

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "posprobe"
# posprobe's kind names and TransformerLens's names for them: each family's own answer, never spelled elsewhere.
KIND_WORDS = {f.kind for f in F.FAMILIES.values()} | {n for f in F.FAMILIES.values() for n in f.tl_names}
# Exact literals that are not kinds though they spell one, each with why.
NOT_KINDS = {
    ("posprobe/backend/facts.py", "rotary"): "the ModelFacts field `rotary` (per-layer RotarySpecs), popped for print",
    ("posprobe/backend/architectures.py", "alibi"): "Falcon's config flag `alibi` (a defect's condition)",
    ("posprobe/zoo/members.py", "sinusoidal"): "a zoo member's name",
    ("posprobe/zoo/members.py", "alibi"): "a zoo member's name",
    ("posprobe/zoo/members.py", "nope"): "a zoo member's name",
}


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def kind_literals(path: Path) -> list[tuple[int, str]]:
    """(line, literal) for every string constant of `path` that is exactly a positional kind's name (docstrings and
    f-string text excepted)."""
    tree = ast.parse(path.read_text())
    skip = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            skip |= {id(v) for v in node.values}
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in KIND_WORDS and id(n) not in skip]


def test_no_positional_kind_literal_outside_the_families():
    found = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("posprobe/backend/families/"):
            continue
        found += [f"{rel}:{line}: {lit!r}" for line, lit in kind_literals(path) if (rel, lit) not in NOT_KINDS]
    assert not found, "ask the family (posprobe.backend.families) instead:\n" + "\n".join(found)


def test_the_kind_literal_check_catches_one(tmp_path):
    # The check above must see a comparison against a kind, and must not see a docstring or an f-string's text.
    p = tmp_path / "m.py"
    p.write_text('"""rotary"""\nx = f"rotary {1}"\nif kind == "alibi":\n    pass\n')
    assert kind_literals(p) == [(3, "alibi")]


def test_the_lists_are_read_from_the_table():
    from posprobe.backend import hf

    assert A.proven(A.LONG) == tuple(mt for mt, a in A.ARCHITECTURES.items() if A.LONG in a.proven)
    assert set(A.proven(A.POSITIONS)) <= set(A.proven(A.PATTERN))  # a proven position layout has a proven pattern
    with pytest.raises(KeyError, match="known: positions"):
        A.proven("everything")
    for mt in ("gptj", "cohere", "glm"):
        assert A.lookup(mt).pairing == "adjacent"
    assert A.lookup("LLAMA") is A.ARCHITECTURES["llama"] and A.lookup("nonesuch").proven == frozenset()
    assert hf_is_encoder({"model_type": "roberta"}) and not hf_is_encoder({"model_type": "gpt2"})
    assert "ADJACENT_PAIR_MODEL_TYPES" not in vars(hf)  # the table is the one place


def test_a_registered_row_reaches_peek(monkeypatch):
    row = A.Architecture("posprobe-dummy", family=F.alibi.FAMILY, encoder=True)
    monkeypatch.setitem(A.ARCHITECTURES, row.model_type, row)
    assert hf_positional_kind({"model_type": "posprobe-dummy"}) == F.ALIBI
    assert hf_is_encoder({"model_type": "posprobe-dummy"})
    A.unregister("posprobe-dummy")
    assert hf_positional_kind({"model_type": "posprobe-dummy"}) == F.UNKNOWN


def test_a_changed_row_reaches_info(tmp_path, monkeypatch, capsys):
    # The tiny Llama folder posprobe proves at every level; with its row's levels emptied, `posprobe info` names it
    # unproven for position analyses and for attention patterns.
    import torch
    import transformers as T

    from posprobe.backend.tiny import byte_tokenizer
    from posprobe.cli.main import main

    cfg = T.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=64, vocab_size=259)
    torch.manual_seed(0)
    T.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "m")
    byte_tokenizer().save_pretrained(tmp_path / "m")

    def info() -> dict:
        assert main(["info", str(tmp_path / "m"), "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    assert info()["unsupported"] is None
    monkeypatch.setitem(A.ARCHITECTURES, "llama", A.Architecture("llama"))
    got = info()
    assert re.search(r"LlamaForCausalLM \(llama\) has not been proven", got["unsupported"])
    assert "hook_pattern has not been proven" in got["attention_unsupported"]


def test_the_support_matrix_agrees_with_the_table():
    # A family row of docs/support-matrix.md with position control ✓ is proven at POSITIONS, with heads ✓ at PATTERN,
    # with long-context ✓ at LONG, by its model type (tests/families.py builds each from that type's config).
    from families import model_type_of

    rows = [line.split("|")[1:-1] for line in (ROOT / "docs" / "support-matrix.md").read_text().splitlines()
            if line.startswith("| ") and not line.startswith("| family")]
    head = [c.strip() for c in next(line for line in (ROOT / "docs" / "support-matrix.md").read_text().splitlines()
                                    if line.startswith("| family")).split("|")[1:-1]]
    checked = 0
    for cells in rows:
        cell = dict(zip(head, (c.strip() for c in cells)))
        mt = model_type_of(cell["family"])
        if mt is None:
            continue
        levels = A.lookup(mt).proven
        for column, level in (("position control", A.POSITIONS), ("heads", A.PATTERN), ("long-context", A.LONG)):
            if cell[column] == "✓":
                assert level in levels, (cell["family"], mt, column)
                checked += 1
    assert checked >= 40


def test_pix2struct_class_facts_live_on_its_row():
    # What Pix2Struct's text decoder class does (loss without a label shift, cross-attention a decoder-only forward
    # never uses, a whole LM named like a backbone, causal only with is_decoder) is its architecture row's, read by
    # the zoo's loop and the backend alike; the zoo's member rows do not restate it.
    from dataclasses import fields

    from posprobe.zoo.members import MEMBERS, Member

    row = A.lookup("pix2struct_text_model")
    assert (row.shifts_labels, row.unused_weights, row.whole_lm, row.causal_flag) == (
        False, "encoder_decoder_attention", True, "is_decoder")
    others = [a for a in A.ARCHITECTURES.values() if a is not row]
    assert all(a.shifts_labels and a.unused_weights is None and not a.whole_lm and a.causal_flag is None
               for a in others)
    assert MEMBERS["t5"].architecture is row
    assert not {f.name for f in fields(Member)} & {"shifts_labels", "unused", "unused_weights", "whole_lm"}
    cfg = type("C", (), {"is_decoder": False})()
    assert "is_decoder=False" in row.not_causal("Pix2StructTextModel", cfg)
    assert row.not_causal("Pix2StructTextModel", type("C", (), {"is_decoder": True})()) is None
    assert A.lookup("llama").not_causal("LlamaForCausalLM", cfg) is None
