"""Tool calling and reasoning on ``/v1/chat/completions``, through the official ``openai``
client against a real ``loom serve`` (the default model with a Hermes-style tool template, as
Qwen2.5's renders tools).

Oracles: arguments validate against each function's JSON schema (``jsonschema``); answers the
model is made to write (the example plug-in's ``example_force_token`` forces a script of
tokens) come back split exactly as the script was written; a stream's deltas add up to the
non-streamed message.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from loom.testing.templates import HERMES_TEMPLATE
from tests.conftest import http_post
from tests.test_server import Server

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 20}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def server(tmp_path_factory, smol_gguf):
    path = tmp_path_factory.mktemp("tpl") / "hermes.jinja"
    path.write_text(HERMES_TEMPLATE)
    s = Server("--chat-template", str(path), "--reasoning-parser", "qwen3")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def tok(smol_gguf):
    from loom.model_loader.gguf_loader import GGUFLoader

    return GGUFLoader().load_tokenizer(smol_gguf)


def scripted(tok, text: str) -> dict:
    """Request fields that make the model write ``text``, then end its turn."""
    ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    return {
        "custom_logit_processor": "example_force_token",
        "custom_params": {"token_ids": ids},
    }


def validate(call, tools) -> dict:
    schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == call.name)
    args = json.loads(call.arguments)
    jsonschema.validate(args, schema)
    return args


def streamed(client, **kw):
    """The stream's pieces joined: content, reasoning, tool calls by index, finish reason."""
    content, thought, calls, reason = "", "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        d = ch.delta
        content += d.content or ""
        thought += getattr(d, "reasoning_content", None) or ""
        for c in d.tool_calls or []:
            slot = calls.setdefault(c.index, {"id": None, "name": "", "arguments": ""})
            if c.id:
                assert slot["id"] is None, "a call's id comes once"
                slot["id"] = c.id
            if c.function and c.function.name:
                slot["name"] += c.function.name
            if c.function and c.function.arguments:
                slot["arguments"] += c.function.arguments
        reason = ch.finish_reason or reason
    return content, thought, [calls[i] for i in sorted(calls)], reason


def test_named_function_always_parses_and_validates(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
        max_tokens=96, temperature=0,
    )  # fmt: skip
    ch = r.choices[0]
    assert ch.finish_reason == "stop"  # as OpenAI ends a forced call
    assert ch.message.content is None and len(ch.message.tool_calls) == 1
    call = ch.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    validate(call.function, [WEATHER])
    content, _, calls, reason = streamed(
        client, model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
        max_tokens=96, temperature=0,
    )  # fmt: skip
    assert content == "" and reason == "stop"
    assert [(c["name"], c["arguments"]) for c in calls] == [
        ("get_weather", call.function.arguments)
    ]


@pytest.mark.parametrize("parallel", [False, True])
def test_required_calls_validate(client, parallel):
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
        parallel_tool_calls=parallel, max_tokens=160, temperature=0,
    )  # fmt: skip
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    calls = ch.message.tool_calls
    assert calls and (parallel or len(calls) == 1)
    assert len({c.id for c in calls}) == len(calls)
    for c in calls:
        validate(c.function, [WEATHER, TIME])
    _, _, streamed_calls, reason = streamed(
        client, model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
        parallel_tool_calls=parallel, max_tokens=160, temperature=0,
    )  # fmt: skip
    assert reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in streamed_calls] == [
        (c.function.name, c.function.arguments) for c in calls
    ]


def test_auto_finds_the_calls_the_model_writes(client, tok):
    text = (
        "Let me check.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
        "</tool_call>\n<tool_call>\n"
        '{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
    )
    from concurrent.futures import ThreadPoolExecutor

    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=200)
    extra = scripted(tok, text)
    # the three requests (whole, streamed, tool_choice none) at once: one batch of decode steps
    with ThreadPoolExecutor(3) as pool:
        whole = pool.submit(client.chat.completions.create, **kw, extra_body=extra)
        stream = pool.submit(streamed, client, **kw, extra_body=extra)
        plain = pool.submit(
            client.chat.completions.create, **kw, tool_choice="none", extra_body=extra
        )
    ch = whole.result().choices[0]
    assert ch.finish_reason == "tool_calls"
    assert ch.message.content.strip() == "Let me check."
    got = [(c.function.name, json.loads(c.function.arguments)) for c in ch.message.tool_calls]
    assert got == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}),
        ("get_time", {"zone": "CET"}),
    ]
    content, _, calls, reason = stream.result()
    assert reason == "tool_calls" and content.strip() == "Let me check."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == got
    # tool_choice none: the same text is plain content
    r = plain.result()
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content == text and r.choices[0].finish_reason == "stop"


def test_reasoning_is_split_from_the_answer(client, tok):
    text = "<think>\nParis is the capital.\n</think>\n\nThe capital is Paris."
    kw = dict(model=MODEL, messages=ASK, max_tokens=100, extra_body=scripted(tok, text))
    msg = client.chat.completions.create(**kw).choices[0].message
    assert msg.reasoning_content == "\nParis is the capital.\n"
    assert msg.content == "The capital is Paris."
    content, thought, _, _ = streamed(client, **kw)
    assert (thought, content) == (msg.reasoning_content, msg.content)
    whole = (
        client.chat.completions.create(
            **{**kw, "extra_body": {**kw["extra_body"], "separate_reasoning": False}}
        )
        .choices[0]
        .message
    )
    assert whole.content == text


def test_thinking_switched_off_by_the_template(client, tok):
    """The template closes an empty thought block in the prompt: the answer is all content,
    and a constraint applies from its first token."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    msg = r.choices[0].message
    assert msg.reasoning_content is None
    jsonschema.validate(json.loads(msg.content), schema)


def test_history_with_tool_calls_and_results(client, server):
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]
    r = client.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER], max_tokens=8, temperature=0
    )
    short = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=8, temperature=0
    )
    assert r.usage.prompt_tokens > short.usage.prompt_tokens + 20


BAD_TOOLS = [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": "get_weather"}, "tools"),
]  # fmt: skip


@pytest.mark.parametrize("body,param", BAD_TOOLS)
def test_bad_tool_definitions_are_refused_by_name(server, body, param):
    r = http_post(server.url + "/v1/chat/completions", json={"messages": ASK, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] is not None and err["param"].startswith(param), err


def test_twenty_tool_definitions_validate_under_a_named_choice(client):
    """Every one of the twenty varied definitions (nested objects, bounded arrays, enums,
    oneOf/anyOf, patterns, $defs/$ref, recursion, no parameters) forced by name: the arguments
    parse and validate against its schema, whatever the model writes."""
    from concurrent.futures import ThreadPoolExecutor

    from loom.testing.tools import TOOL_DEFS

    def call(d):
        r = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Call {d.name} with {json.dumps(d.valid)}"}],
            tools=[d.tool],
            tool_choice={"type": "function", "function": {"name": d.name}},
            max_tokens=400,
            temperature=0,
            frequency_penalty=1.0,  # a 135M model loops inside long strings otherwise
        )
        return d, r.choices[0]

    with ThreadPoolExecutor(len(TOOL_DEFS)) as pool:
        results = list(pool.map(call, TOOL_DEFS))
    assert len(results) == 20
    for d, ch in results:
        assert ch.finish_reason == "stop", (d.name, ch)
        (tc,) = ch.message.tool_calls
        assert tc.function.name == d.name
        jsonschema.validate(json.loads(tc.function.arguments), d.parameters)
