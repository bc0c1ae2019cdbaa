"""Closing within the budget (``constrained/closing.py``): the completion the walk finds from a
grammar state ends the answer valid (``jsonschema`` is the oracle), answers steered near
``max_new_tokens`` validate where unsteered ones run out, and answers that never approach the
budget are unchanged."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

import loom
from loom import plugins
from loom.constrained.closing import BudgetCloser
from tests.conftest import chat_ids

BACKENDS = ["xgrammar", "llguidance"]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "contact": {
            "type": "object",
            "properties": {
                "email": {"type": "string", "format": "email"},
                "notes": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["email", "notes"],
        },
        "bio": {"type": "string"},
    },
    "required": ["name", "contact", "bio"],
}
SCHEMAS = [
    PERSON,
    {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["a", "bb"]}, "minItems": 2},
            "count": {"type": "integer", "minimum": 3},
            "ok": {"type": "boolean"},
            "id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]+$"},
            "day": {"type": "string", "format": "date"},
        },
        "required": ["tags", "count", "ok", "id", "day"],
    },
    {"type": "array", "items": {"$ref": "#/$defs/n"}, "$defs": {"n": {"type": "number"}}},
]
# prefixes a sampled answer may stop at (the backends' own separators)
PREFIXES = {
    "xgrammar": ['{"name": "Derya", "contact": {"email": "d', '{"name": "a very long n'],
    "llguidance": ['{"name":"Derya","contact":{"email":"d', '{"name":"a very long n'],
}


def _check(schema):
    return jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
    )


@pytest.mark.parametrize("name", BACKENDS)
def test_the_walk_completes_every_state_validly(engine, name):
    backend = plugins.resolve("grammar_backend", name)(
        engine.tokenizer, engine.vocab_size, sorted(engine.eos_token_ids)
    )
    closer = BudgetCloser(backend)
    for schema in SCHEMAS:
        m = backend.matcher(backend.compile("json_schema", json.dumps(schema)))
        steps = closer.completion(m)
        text = "".join(t for t, _ in steps)
        assert _check(schema).is_valid(json.loads(text)), text
    for prefix in PREFIXES[name]:
        m = backend.matcher(backend.compile("json_schema", json.dumps(PERSON)))
        assert all(
            m.accept_token(t) for t in engine.tokenizer.encode(prefix, add_special_tokens=False)
        )
        text = prefix + "".join(t for t, _ in closer.completion(m))
        assert _check(PERSON).is_valid(json.loads(text)), text
    # a regex: the walk finds the format's separators (the fewest continuations after them)
    m = backend.matcher(backend.compile("regex", r"[a-z]+@[a-z]+\.com"))
    text = "".join(t for t, _ in closer.completion(m))
    assert re.fullmatch(r"[a-z]+@[a-z]+\.com", text), text


@pytest.fixture(scope="module", params=BACKENDS)
def gengine(request):
    with loom.Engine(grammar_backend=request.param, max_total_tokens=8192) as e:
        yield e


def test_answers_close_within_the_budget(gengine):
    """PERSON at 48 tokens, sampled: unsteered, the model writes a long email and runs out;
    steered (the default for JSON schemas), every answer validates and says where closing
    began. A regex at 12 tokens likewise, with close_within_budget asked for."""
    e = gengine
    ids = chat_ids(e, "Describe a person as JSON with a long biography.")
    params = {"max_new_tokens": 48, "temperature": 1.0, "json_schema": json.dumps(PERSON)}
    rows = [{**params, "sampling_seed": s} for s in range(4)]
    free = e.generate(
        input_ids=[ids] * 4, sampling_params=[{**p, "close_within_budget": False} for p in rows]
    )
    assert any(o["meta_info"]["finish_reason"]["type"] == "length" for o in free)
    steered = e.generate(input_ids=[ids] * 4, sampling_params=rows)
    for o in steered:
        reason = o["meta_info"]["finish_reason"]
        assert reason["type"] == "stop", o["text"]
        assert _check(PERSON).is_valid(json.loads(o["text"])), o["text"]
    assert any("closed_within_budget_at" in o["meta_info"]["finish_reason"] for o in steered)
    regex = {"max_new_tokens": 12, "temperature": 1.0, "regex": r"[a-z]+@[a-z]+\.com"}
    for s in range(3):
        out = e.generate(
            input_ids=chat_ids(e, "Write a very long email address."),
            sampling_params={**regex, "sampling_seed": s, "close_within_budget": True},
        )
        assert re.fullmatch(r"[a-z]+@[a-z]+\.com", out["text"]), out["text"]


def test_answers_far_from_the_budget_are_unchanged(gengine):
    e = gengine
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    ids = chat_ids(e, "Is the sky blue? Answer as JSON.")
    p = {"max_new_tokens": 200, "temperature": 0, "json_schema": json.dumps(schema)}
    on = e.generate(input_ids=ids, sampling_params=p)
    off = e.generate(input_ids=ids, sampling_params={**p, "close_within_budget": False})
    assert on["output_ids"] == off["output_ids"]
    assert "closed_within_budget_at" not in on["meta_info"]["finish_reason"]
    with pytest.raises(ValueError, match="close_within_budget"):
        e.generate(input_ids=ids, sampling_params={**p, "close_within_budget": "yes"})
