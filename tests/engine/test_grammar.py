"""Grammars and token masks (loraplex.engine.grammar), against an independent validator.

Random walks through the masks of the tiny model's byte-level tokenizer: every text the
grammar lets finish must satisfy the constraint as ``jsonschema`` / ``re`` read it, and the
masks must never leave a walk with no allowed token.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
import torch

from loraplex.engine.grammar import Constraint, GrammarCompiler, MaskFiller
from loraplex.engine.sampling_params import GrammarSpec
from loraplex.errors import InvalidRequestError
from loraplex.model.sampler import SamplingRow, apply_allowed
from loraplex.testing import build_tokenizer

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
    "required": ["name", "age", "zip"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, Path]:
    out = tmp_path_factory.mktemp("grammar_tok")
    return build_tokenizer(out), out


@pytest.fixture(scope="module")
def compiler(tokenizer: tuple[object, Path]) -> Iterator[GrammarCompiler]:
    tok, out = tokenizer
    compiler = GrammarCompiler((out / "tokenizer.json").read_text(), 400,  # > the 384 tokens
                               [tok.eos_token_id])  # type: ignore[attr-defined]
    yield compiler
    compiler.close()


def _allowed(filler: MaskFiller, constraints: list[Constraint]) -> torch.Tensor:
    """Which tokens each constraint allows next, as the sampler reads the masks."""
    masks = filler.fill(constraints)
    rows = [SamplingRow(allowed=lambda i=i: masks[i]) for i in range(len(constraints))]
    logits = torch.zeros(len(constraints), filler.vocab_size)
    return torch.isfinite(apply_allowed(logits, logits, rows))


def _walk(compiler: GrammarCompiler, constraint: Constraint, eos: int, seed: int,
          max_tokens: int = 120) -> tuple[list[int], bool]:
    """Samples uniformly among allowed tokens; returns the tokens and whether it ended by
    the grammar's own end (EOS allowed and drawn, or nothing more admitted)."""
    filler = MaskFiller(compiler.vocab_size, num_threads=1)
    rng = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for _ in range(max_tokens):
        if constraint.is_finished:
            return out, True
        allowed = _allowed(filler, [constraint])[0].nonzero().flatten()
        assert allowed.numel() > 0, "the mask allowed no token"
        # Prefer ending when allowed, half the time, so walks finish.
        if eos in allowed.tolist() and torch.rand(1, generator=rng).item() < 0.5:
            return out, True
        token = int(allowed[torch.randint(allowed.numel(), (1,), generator=rng)])
        if token == eos:
            return out, True
        constraint.advance(token)
        assert constraint.error is None
        out.append(token)
    return out, False


def test_json_schema_walks_validate(compiler: GrammarCompiler,
                                    tokenizer: tuple[object, Path]) -> None:
    tok = tokenizer[0]
    eos = tok.eos_token_id  # type: ignore[attr-defined]
    spec = GrammarSpec.json_schema(SCHEMA)
    finished = 0
    for seed in range(12):
        tokens, ended = _walk(compiler, compiler.constraint(spec), eos, seed, max_tokens=400)
        if ended:
            finished += 1
            text = tok.decode(tokens)  # type: ignore[attr-defined]
            jsonschema.validate(json.loads(text), SCHEMA)
    assert finished >= 6


@pytest.mark.parametrize(("spec", "check"), [
    (GrammarSpec("regex", r"[a-c]{2,4}-[0-9]+", "guided_regex"),
     lambda text: re.fullmatch(r"[a-c]{2,4}-[0-9]+", text)),
    (GrammarSpec.choice(["yes", "no", "maybe so"]),
     lambda text: text in ("yes", "no", "maybe so")),
    (GrammarSpec("json_object"), lambda text: isinstance(json.loads(text), dict)),
    (GrammarSpec("grammar", 'start: "(" num ")"\nnum: /[0-9]+/', "guided_grammar"),
     lambda text: re.fullmatch(r"\([0-9]+\)", text)),
    (GrammarSpec("grammar", 'root ::= "<" [a-z]+ ">"', "guided_grammar"),  # GBNF
     lambda text: re.fullmatch(r"<[a-z]+>", text)),
])
def test_other_constraints_walk_to_valid_text(compiler: GrammarCompiler,
                                              tokenizer: tuple[object, Path],
                                              spec: GrammarSpec, check: object) -> None:
    tok = tokenizer[0]
    finished = 0
    for seed in range(8):
        tokens, ended = _walk(compiler, compiler.constraint(spec),
                              tok.eos_token_id, seed)  # type: ignore[attr-defined]
        if ended:
            finished += 1
            text = tok.decode(tokens)  # type: ignore[attr-defined]
            assert check(text), text  # type: ignore[operator]
    assert finished >= 4


def test_forked_constraints_are_independent(compiler: GrammarCompiler,
                                            tokenizer: tuple[object, Path]) -> None:
    tok = tokenizer[0]
    first = compiler.constraint(GrammarSpec.choice(["ab", "cd"]))
    second = first.fork()
    first.advance(tok.convert_tokens_to_ids("a"))  # type: ignore[attr-defined]
    allowed = _allowed(MaskFiller(compiler.vocab_size, num_threads=1), [first, second])
    c = tok.convert_tokens_to_ids("c")  # type: ignore[attr-defined]
    assert not allowed[0, c] and allowed[1, c]


def test_compiled_once_per_digest(compiler: GrammarCompiler) -> None:
    before = compiler.num_compiles
    a = GrammarSpec.json_schema({"type": "object", "properties": {"x": {"type": "integer"}},
                                 "required": ["x"]})
    b = GrammarSpec.json_schema({"required": ["x"], "properties": {"x": {"type": "integer"}},
                                 "type": "object"})  # the same schema, keys reordered
    assert a.digest == b.digest
    compiler.constraint(a)
    compiler.constraint(b)
    assert compiler.num_compiles == before + 1


def test_rows_without_constraint_are_untouched(compiler: GrammarCompiler) -> None:
    masks = MaskFiller(compiler.vocab_size, num_threads=1).fill(
        [compiler.constraint(GrammarSpec.choice(["a"]))])
    rows = [SamplingRow(), SamplingRow(allowed=lambda: masks[0]), SamplingRow()]
    raw = torch.randn(3, compiler.vocab_size)
    before = raw.clone()
    out = apply_allowed(raw, raw, rows)
    assert torch.equal(raw, before)  # the raw logits (for logprobs) stay as they were
    assert torch.equal(out[0], raw[0]) and torch.equal(out[2], raw[2])
    assert 0 < torch.isfinite(out[1]).sum() < 5


def test_the_grammar_wins_over_min_tokens(compiler: GrammarCompiler,
                                          tokenizer: tuple[object, Path]) -> None:
    """A row whose grammar allows only tokens that min_tokens bans keeps the grammar's."""
    a = tokenizer[0].convert_tokens_to_ids("a")  # type: ignore[attr-defined]
    masks = MaskFiller(compiler.vocab_size, num_threads=1).fill(
        [compiler.constraint(GrammarSpec.choice(["a"]))])
    raw = torch.randn(1, compiler.vocab_size)
    banned = raw.clone()
    banned[0, a] = float("-inf")
    out = apply_allowed(banned, raw, [SamplingRow(allowed=lambda: masks[0])])
    assert out[0].argmax() == a


@pytest.mark.parametrize(("spec", "param", "words"), [
    (lambda: GrammarSpec.json_schema({"type": "strnig"}), "response_format", "compiled"),
    (lambda: GrammarSpec.json_schema({"type": "object", "properties": {"x": {
        "type": "string", "format": "no-such-format"}}}), "response_format", "compiled"),
    (lambda: GrammarSpec.json_schema([1, 2]), "response_format", "object"),
    (lambda: GrammarSpec("regex", "(unclosed", "guided_regex"), "guided_regex", "compiled"),
    (lambda: GrammarSpec("regex", "", "guided_regex"), "guided_regex", "empty"),
    (lambda: GrammarSpec("grammar", "start: undefined_rule", "guided_grammar"),
     "guided_grammar", "compiled"),
    (lambda: GrammarSpec.choice([]), "guided_choice", "list"),
    (lambda: GrammarSpec.choice(["a", 3]), "guided_choice", "list"),
    (lambda: GrammarSpec("regex", "a" * 70000, "guided_regex"), "guided_regex", "longer"),
])
def test_bad_constraints_name_their_field(compiler: GrammarCompiler, spec: object,
                                          param: str, words: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        compiler.constraint(spec())  # type: ignore[operator]
    assert info.value.param == param
    assert words in str(info.value)
