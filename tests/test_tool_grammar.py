"""The constraints of tool_choice required and named: for each of the twenty tools the schema
compiles in Loom's grammar backends (xgrammar, llguidance), whose matchers accept the
hand-written valid arguments and refuse the invalid ones (the oracle: ``jsonschema`` agrees on
both); the constrained output parses back into the calls, whole or streamed in any pieces."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from loom.constrained.llguidance_backend import strict_schema
from loom.function_call import (
    ToolCall,
    ToolChoice,
    calls_from_required,
    constrained_streaming,
    constraint_schema,
    fold_events,
    parse_tool_fields,
)
from loom.testing.tool_call_parser import splits
from loom.testing.tools import BY_NAME, TOOL_DEFS, TOOLS

TOOL_LIST = parse_tool_fields(TOOLS).tools
BACKENDS = ["xgrammar", "llguidance"]
# how each backend writes JSON (neither allows free whitespace)
SEPARATORS = {"xgrammar": (", ", ": "), "llguidance": (",", ":")}


def _dump(value, backend: str) -> str:
    return json.dumps(value, ensure_ascii=False, separators=SEPARATORS[backend])


@pytest.fixture(scope="module")
def byte_tokenizer():
    """A tokenizer with one token per byte (and an end-of-sequence token), so that any text
    has exactly one tokenization for the matchers to walk."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    vocab["<eos>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request, byte_tokenizer):
    from loom import plugins

    cls = plugins.resolve("grammar_backend", request.param)
    tok = byte_tokenizer
    b = cls(tok, len(tok), [tok.eos_token_id])
    b.name = request.param
    return b


def accepts(backend, schema: dict, text: str) -> bool:
    """Whether the backend's matcher for ``schema`` takes ``text`` and then may end."""
    m = backend.matcher(backend.compile("json_schema", json.dumps(schema)))
    tok = backend.tokenizer
    if not all(m.accept_token(t) for t in tok.encode(text, add_special_tokens=False)):
        return False
    return m.is_terminated() or (m.accept_token(tok.eos_token_id) and m.is_terminated())


def test_examples_follow_their_schemas():
    """The oracle itself: each valid example validates, each invalid one does not (in strict
    mode, as the backends compile: no properties beyond the schema's)."""
    for d in TOOL_DEFS:
        jsonschema.Draft202012Validator.check_schema(d.parameters)
        jsonschema.validate(d.valid, d.parameters)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(d.invalid, strict_schema(d.parameters))


@pytest.mark.parametrize("name", [d.name for d in TOOL_DEFS])
def test_named(backend, name):
    d = BY_NAME[name]
    choice = ToolChoice("named", name)
    schema = constraint_schema(TOOL_LIST, choice)
    assert schema == d.parameters  # the output is the arguments
    text = _dump(d.valid, backend.name)
    assert accepts(backend, schema, text), f"{backend.name} refuses {text}"
    assert not accepts(backend, schema, _dump(d.invalid, backend.name))
    # the output is the arguments: streamed as they come, the call named by tool_choice
    for pieces in [[text], list(text)]:
        s = constrained_streaming(TOOL_LIST, choice, lambda: "call_0")
        events = [e for p in pieces for e in s.feed(p)] + s.finish()
        assert fold_events(events).calls == [ToolCall(name, text, "call_0")]


def _required(defs, backend: str) -> str:
    return _dump([{"name": d.name, "parameters": d.valid} for d in defs], backend)


@pytest.mark.parametrize("parallel", [True, False])
def test_required(backend, parallel):
    choice = ToolChoice("required")
    schema = constraint_schema(TOOL_LIST, choice, parallel)
    every = _required(TOOL_DEFS, backend.name)
    # jsonschema agrees (so the $ref rewriting kept the schemas' meaning): all twenty calls
    # at once only when parallel calls are allowed
    if parallel:
        jsonschema.validate(json.loads(every), schema)
    else:
        with pytest.raises(jsonschema.ValidationError, match="too long"):
            jsonschema.validate(json.loads(every), schema)
    assert accepts(backend, schema, every) == parallel
    for d in TOOL_DEFS:
        one = _required([d], backend.name)
        assert accepts(backend, schema, one), f"{backend.name} refuses {one}"
        bad = _dump([{"name": d.name, "parameters": d.invalid}], backend.name)
        assert not accepts(backend, schema, bad), f"{backend.name} takes {bad}"
    assert not accepts(backend, schema, "[]")
    assert not accepts(backend, schema, _dump([{"name": "launch", "parameters": {}}], backend.name))
    assert not accepts(
        backend, schema, _dump({"name": "add", "parameters": {"a": 1, "b": 2}}, backend.name)
    )


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_required_output_becomes_calls(backend_name):
    """The calls of a constrained output, whole or streamed: names in order, arguments that
    validate against each tool's schema (and equal the example)."""
    text = _required(TOOL_DEFS, backend_name)
    calls = calls_from_required(text, TOOL_LIST, iter(f"call_{i}" for i in range(99)).__next__)
    assert [c.name for c in calls] == [d.name for d in TOOL_DEFS]
    assert [c.id for c in calls] == [f"call_{i}" for i in range(20)]
    for call, d in zip(calls, TOOL_DEFS, strict=True):
        args = json.loads(call.arguments)
        jsonschema.validate(args, d.parameters)
        assert args == d.valid
    # without the tools (any name: the grammar allowed only theirs), ids in OpenAI's shape
    plain = calls_from_required(text)
    assert [(c.name, c.arguments) for c in plain] == [(c.name, c.arguments) for c in calls]
    assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", c.id) for c in plain)
    short = _required(TOOL_DEFS[:2], backend_name)
    for pieces in splits(short):
        ids = iter(f"call_{i}" for i in range(9))
        s = constrained_streaming(TOOL_LIST, ToolChoice("required"), ids.__next__)
        events = [e for p in pieces for e in s.feed(p)] + s.finish()
        got = fold_events(events)
        assert got.content == ""
        assert [(c.name, json.loads(c.arguments)) for c in got.calls] == [
            (d.name, d.valid) for d in TOOL_DEFS[:2]
        ]


def test_refs_to_the_root_survive_embedding(backend):
    """A recursive schema that points at its own root (``"$ref": "#"``) still means the same
    once it sits inside the required array."""
    linked = {
        "type": "object",
        "properties": {
            "value": {"type": "integer"},
            "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]},
        },
        "required": ["value", "next"],
    }
    tools = parse_tool_fields(
        [{"type": "function", "function": {"name": "push", "parameters": linked}}, TOOLS[0]]
    ).tools
    schema = constraint_schema(tools, ToolChoice("required"))
    value = [{"name": "push", "parameters": {"value": 1, "next": {"value": 2, "next": None}}}]
    jsonschema.validate(value, schema)
    assert accepts(backend, schema, _dump(value, backend.name))
    wrong = [{"name": "push", "parameters": {"value": 1, "next": {"value": "2", "next": None}}}]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(wrong, schema)
    assert not accepts(backend, schema, _dump(wrong, backend.name))


def test_free_choices_have_no_constraint():
    assert constraint_schema(TOOL_LIST, ToolChoice("auto")) is None
    assert constraint_schema(TOOL_LIST, ToolChoice("none")) is None
    assert constraint_schema([], ToolChoice("required")) is None
    assert constrained_streaming(TOOL_LIST, ToolChoice("auto")) is None
    with pytest.raises(ValueError, match="nope"):
        constraint_schema(TOOL_LIST, ToolChoice("named", "nope"))
