"""Every JSON-schema bound enforced by both grammar backends, or refused by name (issue: structured
output that always validates). The oracle is ``jsonschema``: for each keyword a schema where only
that keyword rules out an instance; the instance ``jsonschema`` accepts must pass the backend's
matcher token by token to the end, the one it rejects must be refused. Then sampled answers of
the default model validate, and what a backend cannot enforce is a 400 naming the keyword and
its JSON pointer."""

from __future__ import annotations

import json

import jsonschema
import pytest

import loom
from loom import plugins
from loom.constrained.base import GrammarError
from loom.constrained.schema_support import schema_gaps
from tests.conftest import chat_ids

BACKENDS = ["xgrammar", "llguidance"]

# keyword: (schema, an instance it allows, one only that keyword rules out)
BOUNDS = {
    "maxLength beside pattern": (
        {"type": "string", "pattern": "^[a-z]+$", "maxLength": 5},
        "abc",
        "abcdefghij",
    ),
    "minLength beside pattern": (
        {"type": "string", "pattern": "^[a-z]+$", "minLength": 5},
        "abcdef",
        "ab",
    ),
    "maxLength beside format": (
        {"type": "string", "format": "email", "maxLength": 10},
        "a@b.co",
        "abcdefghij@example.com",
    ),
    "maxLength": ({"type": "string", "maxLength": 5}, "abc", "abcdefgh"),
    "minItems": ({"type": "array", "items": {"type": "integer"}, "minItems": 2}, [1, 2], [1]),
    "maxItems": ({"type": "array", "items": {"type": "integer"}, "maxItems": 2}, [1], [1, 2, 3]),
    "minimum": ({"type": "integer", "minimum": 3}, 5, 2),
    "maximum": ({"type": "integer", "maximum": 10}, 5, 11),
    "exclusiveMinimum": ({"type": "integer", "exclusiveMinimum": 3}, 4, 3),
    "exclusiveMaximum on a number": ({"type": "number", "exclusiveMaximum": 1.5}, 1.25, 1.5),
    "minimum on a number": ({"type": "number", "minimum": 1.5}, 2.5, 1.25),
    "enum": ({"enum": ["a", "b"]}, "a", "c"),
    "const": ({"const": "a"}, "a", "b"),
    "prefixItems": (
        {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False},
        [1, "a"],
        ["a", 1],
    ),
    "additionalProperties schema": (
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "additionalProperties": {"type": "string"},
        },
        {"a": 1, "b": "x"},
        {"a": 1, "b": 2},
    ),
    "$ref recursion": (
        {
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {
                        "v": {"type": "integer"},
                        "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]},
                    },
                    "required": ["v", "next"],
                }
            },
            "$ref": "#/$defs/node",
        },
        {"v": 1, "next": {"v": 2, "next": None}},
        {"v": 1, "next": {"v": "x", "next": None}},
    ),
    "allOf": ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, 4, 2),
    "patternProperties": (
        {
            "type": "object",
            "patternProperties": {"^x": {"type": "integer"}},
            "additionalProperties": False,
        },
        {"x1": 1},
        {"y": 1},
    ),
    "multipleOf": ({"type": "integer", "multipleOf": 5}, 10, 7),
    "minProperties": (
        {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2},
        {"a": 1, "b": 2},
        {"a": 1},
    ),
    "maxProperties": (
        {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 1},
        {"a": 1},
        {"a": 1, "b": 2},
    ),
    "length bound inside anyOf": (
        {"anyOf": [{"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, {"type": "integer"}]},
        "ab",
        "abcdef",
    ),
}

# keyword: (schema, the backends that refuse it, the JSON pointer the error names); where a
# backend does not refuse it, it enforces it (ENFORCED_BY_ONE gives the instances)
REFUSED = {
    "uniqueItems": (
        {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}},
        BACKENDS,
        "#/properties/tags",
    ),
    "not": ({"not": {"type": "string"}}, BACKENDS, "the schema's root"),
    "contains": ({"type": "array", "contains": {"const": 3}}, BACKENDS, "the schema's root"),
    "if": (
        {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}},
        BACKENDS,
        "the schema's root",
    ),
    "dependentRequired": (
        {"type": "object", "dependentRequired": {"a": ["b"]}},
        BACKENDS,
        "the schema's root",
    ),
    "format 'iri'": (
        {"type": "array", "items": {"type": "string", "format": "iri"}},
        BACKENDS,
        "#/items",
    ),
    "format 'json-pointer'": ({"type": "string", "format": "json-pointer"}, ["llguidance"], ""),
    "propertyNames": (
        {
            "type": "object",
            "additionalProperties": {"type": "integer"},
            "propertyNames": {"maxLength": 3},
        },
        ["llguidance"],
        "the schema's root",
    ),
}
ENFORCED_BY_ONE = {
    "format 'json-pointer'": ("/a/b", "a b"),
    "propertyNames": ({"ab": 1}, {"abcd": 1}),
}


@pytest.fixture(scope="module")
def backends(engine):
    eos = sorted(engine.eos_token_ids)
    return {
        name: plugins.resolve("grammar_backend", name)(engine.tokenizer, engine.vocab_size, eos)
        for name in BACKENDS
    }


def _accepts(backend, engine, schema, instance) -> bool:
    """Whether the backend's matcher takes the instance's tokens and may end there (either of
    the two compact JSON spellings the backends write)."""
    for sep in ((",", ":"), (", ", ": ")):
        ids = engine.tokenizer.encode(
            json.dumps(instance, separators=sep), add_special_tokens=False
        )
        m = backend.matcher(backend.compile("json_schema", json.dumps(schema)))
        if all(m.accept_token(t) for t in ids) and (
            m.is_terminated() or m.accept_token(sorted(engine.eos_token_ids)[0])
        ):
            return True
    return False


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("keyword", list(BOUNDS))
def test_each_bound_stops_what_only_it_forbids(engine, backends, name, keyword):
    schema, good, bad = BOUNDS[keyword]
    check = jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
    )
    assert check.is_valid(good) and not check.is_valid(bad)  # (the oracle agrees)
    backend = backends[name]
    assert _accepts(backend, engine, schema, good)
    assert not _accepts(backend, engine, schema, bad), f"{name} lets {bad!r} through"


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("keyword", list(REFUSED))
def test_what_a_backend_cannot_enforce_is_refused_by_name(engine, backends, name, keyword):
    schema, refusing, where = REFUSED[keyword]
    text = json.dumps(schema)
    if name not in refusing:
        good, bad = ENFORCED_BY_ONE[keyword]
        assert _accepts(backends[name], engine, schema, good)
        assert not _accepts(backends[name], engine, schema, bad)
        return
    with pytest.raises(GrammarError, match="is not enforced") as err:
        backends[name].compile("json_schema", text)
    assert keyword in str(err.value) and where in str(err.value)


def test_gaps_name_pointers_and_what_llguidance_adds():
    schema = {
        "type": "object",
        "properties": {
            "a/b": {"type": "string", "format": "uri", "maxLength": 80},
            "list": {"type": "array", "items": {"allOf": [{"type": "integer"}, {"minimum": 1}]}},
        },
    }
    gaps = schema_gaps(schema, "xgrammar")
    assert [(g.keyword, g.pointer, g.llguidance) for g in gaps] == [
        ("maxLength beside format", "#/properties/a~1b", True),
        ("allOf", "#/properties/list/items", True),
    ]
    assert schema_gaps(schema, "llguidance") == []
    assert schema_gaps({"type": "array", "uniqueItems": False}, "xgrammar") == []


def test_a_structural_tags_schemas_are_checked(backends):
    tag = {
        "type": "structural_tag",
        "structures": [
            {
                "begin": "<f>",
                "schema": {"type": "object", "properties": {"x": {"not": {"type": "null"}}}},
                "end": "</f>",
            }
        ],
        "triggers": ["<f>"],
    }
    with pytest.raises(GrammarError, match="structural_tag: not at #/structures/0/schema/prop"):
        backends["xgrammar"].compile("structural_tag", json.dumps(tag))


@pytest.fixture(scope="module", params=BACKENDS)
def sengine(request):
    with loom.Engine(grammar_backend=request.param, max_total_tokens=8192) as e:
        yield e


def test_sampled_answers_keep_a_length_beside_a_pattern(sengine):
    """The default model, sampled: a container image field with a pattern and maxLength (the
    bound XGrammar alone drops) and a bounded email; every answer validates, on both backends,
    in one batch with an unconstrained request."""
    schema = {
        "type": "object",
        "properties": {
            "image": {"type": "string", "pattern": "^[a-z0-9./:-]+$", "maxLength": 12},
            "owner": {"type": "string", "format": "email", "maxLength": 16},
        },
        "required": ["image", "owner"],
    }
    ids = chat_ids(sengine, "Give a container image name and its owner's email as JSON.")
    params = {"max_new_tokens": 64, "temperature": 1.0, "json_schema": json.dumps(schema)}
    outs = sengine.generate(
        input_ids=[ids] * 4,
        sampling_params=[{**params, "sampling_seed": s} for s in range(3)]
        + [{"max_new_tokens": 8}],
    )
    check = jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
    )
    for o in outs[:3]:
        assert o["meta_info"]["finish_reason"]["type"] == "stop", o["text"]
        assert check.is_valid(json.loads(o["text"])), o["text"]
    # refused by name through the engine, which keeps serving
    bad = {"type": "array", "uniqueItems": True}
    with pytest.raises(ValueError, match="uniqueItems at the schema's root"):
        sengine.generate(
            input_ids=ids, sampling_params={"max_new_tokens": 4, "json_schema": json.dumps(bad)}
        )
    assert sengine.generate(input_ids=ids, sampling_params={"max_new_tokens": 2})["output_ids"]


@pytest.mark.parametrize("name", BACKENDS)
def test_no_raw_control_character_inside_a_string_whatever_the_tokenizers_decoder(engine, name):
    """Inside a JSON string the grammar refuses the newline token (``Ċ``, a raw newline) and
    special tokens (XGrammar's masks admit ``<|endoftext|>`` there), and takes a letter, also when the tokenizer's decoder is the ``Sequence[ByteFallback, Fuse,
    Replace, ByteLevel]`` that transformers 5.17 gives SmolLM2's GGUF tokenizer (which
    llguidance read as byte-fallback text: ``Ċ`` a letter, raw newlines in strings)."""
    from copy import deepcopy

    from tokenizers import decoders

    tok = deepcopy(engine.tokenizer)
    tok.backend_tokenizer.decoder = decoders.Sequence(
        [decoders.ByteFallback(), decoders.Fuse(), decoders.Replace("▁", " "), decoders.ByteLevel()]
    )
    newline = tok.convert_tokens_to_ids("Ċ")
    assert tok.decode([newline]) == "\n"
    letter = tok.encode("a", add_special_tokens=False)[0]
    backend = plugins.resolve("grammar_backend", name)(
        tok, engine.vocab_size, sorted(engine.eos_token_ids)
    )
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    compiled = backend.compile("json_schema", json.dumps(schema))
    for start in ('{"a":"', '{"a": "'):  # (the backends' compact spellings differ)
        m = backend.matcher(compiled)
        if all(m.accept_token(t) for t in tok.encode(start, add_special_tokens=False)):
            break
    else:
        raise AssertionError("neither spelling of the object's start was accepted")
    mask = backend.allocate_vocab_mask(1)
    backend.reset_vocab_mask(mask)
    m.fill_vocab_mask(mask, 0)
    words = mask[0].tolist()

    def allowed(i: int) -> bool:
        return (words[i >> 5] >> (i & 31)) & 1 == 1

    assert allowed(letter) and not allowed(newline)
    # nor a special token, which decoding would drop from the answer
    specials = [i for i, t in tok.added_tokens_decoder.items() if t.special]
    specials = [i for i in {*specials, *tok.all_special_ids} if i not in engine.eos_token_ids]
    assert specials and not any(allowed(i) for i in specials)


@pytest.mark.parametrize("name", BACKENDS)
def test_format_date_is_a_calendar_date(engine, backends, name):
    """``format: date`` takes only days that exist (each month's length, leap years), as
    jsonschema's format checker does; by themselves the libraries check its shape only."""
    schema = {
        "type": "object",
        "properties": {"d": {"type": "string", "format": "date"}},
        "required": ["d"],
    }
    check = jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
    )
    for day in (
        "2024-02-29",
        "2000-02-29",
        "2023-06-30",
        "0001-01-01",
        "2023-06-31",
        "2023-02-29",
        "1900-02-29",
        "0000-01-01",
        "2023-13-01",
    ):
        instance = {"d": day}
        assert _accepts(backends[name], engine, schema, instance) == check.is_valid(instance), day
