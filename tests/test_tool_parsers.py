"""Tool calling's route-independent pieces: the request's tools fields checked (each refusal
names its field), every built-in parser on hand-written outputs in its model family's format
(exact content and calls, from the format's spec), streaming equal to parsing the whole output
for every split of it, the conformance kit over every registered parser, and ``auto``'s choice
from chat templates."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loom import plugins
from loom.function_call import (
    ContentDelta,
    ParsedOutput,
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
    ToolCallStream,
    ToolChoice,
    ToolRequest,
    ToolSpecError,
    fold_events,
    make_tool_call_parser,
    new_call_id,
    openai_delta,
    parse_tool_fields,
    parser_for_template,
)
from loom.function_call.formats import HermesParser
from loom.function_call.tools import EMPTY_PARAMETERS
from loom.testing.tool_call_parser import (
    check_streaming,
    check_tool_call_parser,
    make,
    stream_events,
)
from loom.testing.tools import BY_NAME, TOOL_DEFS, TOOLS

TOOL_LIST = parse_tool_fields(TOOLS).tools
BUILTINS = ["hermes", "llama3", "mistral", "pythonic"]


def _fn(name, **function) -> dict:
    return {"type": "function", "function": {"name": name, **function}}


# ---- request fields --------------------------------------------------------------------------


def test_defaults_and_normalisation():
    assert parse_tool_fields() == ToolRequest([], ToolChoice("none"), True)
    req = parse_tool_fields(TOOLS)
    assert req.choice == ToolChoice("auto") and req.parallel and req.enabled
    assert [t.name for t in req.tools] == [d.name for d in TOOL_DEFS]
    # the normalised shape is the request's (what chat templates get), defaults filled in
    assert req.tool("get_weather").openai() == BY_NAME["get_weather"].tool
    assert req.tool("get_time").parameters == EMPTY_PARAMETERS
    assert req.tool("run_code").strict and not req.tool("add").strict
    tools, choice, parallel = parse_tool_fields(TOOLS, "required", False)
    assert choice == ToolChoice("required") and parallel is False and len(tools) == 20


def test_lenient_fields():
    """As vLLM and SGLang: [] is no tools, a missing type is a function, auto/none without
    tools mean none."""
    assert parse_tool_fields([]) == ToolRequest([], ToolChoice("none"), True)
    assert parse_tool_fields([{"function": {"name": "f"}}]).tools[0].name == "f"
    for choice in ("auto", "none"):
        req = parse_tool_fields(None, choice)
        assert req.choice == ToolChoice("none") and not req.enabled
    named = parse_tool_fields([_fn("f"), _fn("g")], {"type": "function", "function": {"name": "g"}})
    assert named.choice == ToolChoice("named", "g") and named.choice.describe() == "function 'g'"
    assert parse_tool_fields([_fn("f")], "none").enabled is False
    assert ToolChoice("required").describe() == "'required'"


@pytest.mark.parametrize(
    "fields, param, match",
    [
        (dict(tools={"type": "function"}), "tools", "array"),
        (dict(tools=["get_weather"]), "tools[0]", "object"),
        (dict(tools=[_fn("a"), {"type": "retrieval"}]), "tools[1].type", '"function"'),
        (dict(tools=[{"type": "function"}]), "tools[0].function", "object"),
        (dict(tools=[_fn("get weather")]), "tools[0].function.name", "1-64"),
        (dict(tools=[_fn("a" * 65)]), "tools[0].function.name", "1-64"),
        (dict(tools=[_fn("")]), "tools[0].function.name", "1-64"),
        (dict(tools=[_fn("a"), _fn("b"), _fn("a")]), "tools[2].function.name", r"duplicate.*\[0\]"),
        (dict(tools=[_fn("a", description=3)]), "tools[0].function.description", "string"),
        (dict(tools=[_fn("a", strict="yes")]), "tools[0].function.strict", "boolean"),
        (dict(tools=[_fn("a", parameters=[])]), "tools[0].function.parameters", "schema"),
        (
            dict(tools=[_fn("a", parameters={"type": "string"})]),
            "tools[0].function.parameters.type",
            '"object"',
        ),
        (
            dict(
                tools=[
                    _fn("ok"),
                    _fn("a", parameters={"type": "object", "properties": {"x": {"type": "nope"}}}),
                ]
            ),
            "tools[1].function.parameters.properties.x.type",
            "not a valid JSON schema",
        ),
        (
            dict(tools=[_fn("a", parameters={"type": "object", "required": "x"})]),
            "tools[0].function.parameters.required",
            "not a valid JSON schema",
        ),
        (
            dict(
                tools=[
                    _fn("a", parameters={"type": "object", "properties": {"x": {"minimum": "3"}}})
                ]
            ),
            "tools[0].function.parameters.properties.x.minimum",
            "not a valid JSON schema",
        ),
        (dict(tools=[_fn("a")], tool_choice="always"), "tool_choice", "none, auto, required"),
        (dict(tools=[_fn("a")], tool_choice=3), "tool_choice", "string or an object"),
        (
            dict(tools=[_fn("a")], tool_choice={"type": "tool", "function": {"name": "a"}}),
            "tool_choice.type",
            '"function"',
        ),
        (
            dict(tools=[_fn("a")], tool_choice={"type": "function"}),
            "tool_choice.function.name",
            "must be a string",
        ),
        (
            dict(tools=[_fn("a")], tool_choice={"type": "function", "function": {"name": "b"}}),
            "tool_choice.function.name",
            r"'b'.*not among the tools \(a\)",
        ),
        (dict(tool_choice="required"), "tool_choice", "needs tools"),
        (
            dict(tool_choice={"type": "function", "function": {"name": "a"}}),
            "tool_choice.function.name",
            "not among",
        ),
        (dict(tools=[_fn("a")], parallel_tool_calls="no"), "parallel_tool_calls", "boolean"),
    ],
)
def test_bad_fields_name_the_field(fields, param, match):
    with pytest.raises(ToolSpecError, match=match) as err:
        parse_tool_fields(**fields)
    assert err.value.param == param
    assert isinstance(err.value, ValueError)


# ---- the built-in formats, by hand ----------------------------------------------------------


def _calls(*pairs: tuple[str, str]) -> list[ToolCall]:
    return [ToolCall(name, args, f"call_{i}") for i, (name, args) in enumerate(pairs)]


PARIS = ("get_weather", '{"city": "Paris", "unit": "celsius"}')
ADD = ("add", '{"a": 1, "b": 2}')

# (parser, output, content, calls): what each format's spec says the output means
CASES = [
    # hermes: Qwen2.5 / Qwen3 / Hermes, one <tool_call> block per call
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
        '"celsius"}}\n</tool_call>',
        "",
        [PARIS],
    ),
    (
        "hermes",
        'I will check both.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"'
        ', "unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, '
        '"b": 2}}\n</tool_call>\n\nDone.\n',
        "I will check both.\n\nDone.\n",
        [PARIS, ADD],
    ),
    ("hermes", "Paris is the capital of France.", "Paris is the capital of France.", []),
    (
        "hermes",
        '<tool_call>\n{"name": "launch_rocket", "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "launch_rocket", "arguments": {}}\n</tool_call>',
        [],
    ),
    (
        "hermes",
        '<tool_call>\nget_weather(city="Paris")\n</tool_call>',
        '<tool_call>\nget_weather(city="Paris")\n</tool_call>',
        [],
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "run_code", "arguments": {"language": "python", "code": '
        '"print(\\"</tool_call>}]\\")"}}\n</tool_call>',
        "",
        [("run_code", '{"language": "python", "code": "print(\\"</tool_call>}]\\")"}')],
    ),
    (  # another key order, arguments as a JSON string: re-serialised
        "hermes",
        '<tool_call>{"arguments": "{\\"a\\": 1, \\"b\\": 2}", "name": "add"}</tool_call>',
        "",
        [ADD],
    ),
    ("hermes", '<tool_call>{"name": "add", "parameters": {"a": 1, "b": 2}}</tool_call>', "", [ADD]),
    (  # cut off by max_tokens: the call keeps what was generated
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
        "",
        [("get_weather", '{"city": "Par')],
    ),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {}}', "", [("get_time", "{}")]),
    ("hermes", "See <tool_ca", "See <tool_ca", []),
    (
        "hermes",
        '<tool_call>\n{"name": "translate", "arguments": {"text": "駅はどこ", "target": "en"}}\n'
        "</tool_call>",
        "",
        [("translate", '{"text": "駅はどこ", "target": "en"}')],
    ),
    # llama3: JSON with "parameters", opening the output or after <|python_tag|>, ';' between
    (
        "llama3",
        '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
        "",
        [PARIS],
    ),
    ("llama3", '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}', "", [ADD]),
    (
        "llama3",
        '{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "get_time", "parameters": {}}',
        "",
        [ADD, ("get_time", "{}")],
    ),
    (
        "llama3",
        'Let me add them.<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}',
        "Let me add them.",
        [ADD],
    ),
    ("llama3", '{"name": "add", "arguments": {"a": 1, "b": 2}}', "", [ADD]),
    (
        "llama3",
        '{"type": "function", "name": "get_time", "parameters": {}}',
        "",
        [("get_time", "{}")],
    ),
    ("llama3", '{"answer": 42}', '{"answer": 42}', []),
    (
        "llama3",
        'The call {"name": "add", "parameters": {}} is an example.',
        'The call {"name": "add", "parameters": {}} is an example.',
        [],
    ),
    (
        "llama3",
        '<|python_tag|>brave_search.call(query="weather")',
        '<|python_tag|>brave_search.call(query="weather")',
        [],
    ),
    # mistral: [TOOL_CALLS] and a JSON array (tokenizer < v11), or name[ARGS]{...} per call
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}'
        '}, {"name": "add", "arguments": {"a": 1, "b": 2}}]',
        "",
        [PARIS, ADD],
    ),
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}, "id": "a1B2c3D4e"}]',
        "",
        [ADD],
    ),
    (
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]add[ARGS]'
        '{"a": 1, "b": 2}',
        "",
        [PARIS, ADD],
    ),
    ("mistral", '[TOOL_CALLS]add[CALL_ID]a1B2c3D4e[ARGS]{"a": 1, "b": 2}', "", [ADD]),
    ("mistral", '[TOOL_CALLS]add{"a": 1, "b": 2}', "", [ADD]),
    ("mistral", "Checking.[TOOL_CALLS]get_time[ARGS]{}", "Checking.", [("get_time", "{}")]),
    (
        "mistral",
        "[TOOL_CALLS]launch_rocket[ARGS]{}",
        "[TOOL_CALLS]launch_rocket[ARGS]{}",
        [],
    ),
    ("mistral", "[TOOL_CALLS]", "[TOOL_CALLS]", []),
    # pythonic: a Python list of calls with keyword arguments (Llama 3.2 / Llama 4)
    (
        "pythonic",
        '[get_weather(city="Paris", unit="celsius"), add(a=1, b=2)]',
        "",
        [PARIS, ADD],
    ),
    (
        "pythonic",
        "[query_database(sql='SELECT 1', params=['x', 2.5, None], timeout_s=None)]",
        "",
        [("query_database", '{"sql": "SELECT 1", "params": ["x", 2.5, null], "timeout_s": null}')],
    ),
    (
        "pythonic",
        '[navigate(destination={"lat": -33.9, "lon": 18.4}, mode="driving"), '
        "search_web(query='loom', max_results=5, safe=True)]",
        "",
        [
            ("navigate", '{"destination": {"lat": -33.9, "lon": 18.4}, "mode": "driving"}'),
            ("search_web", '{"query": "loom", "max_results": 5, "safe": true}'),
        ],
    ),
    (
        "pythonic",
        '[search_web(query="x", safe=true), query_database(sql="x", params=[null, -1], '
        "timeout_s=null)]",
        "",
        [
            ("search_web", '{"query": "x", "safe": true}'),
            ("query_database", '{"sql": "x", "params": [null, -1], "timeout_s": null}'),
        ],
    ),
    (
        "pythonic",
        "On it. <|python_start|>[get_time()]<|python_end|>",
        "On it.",
        [("get_time", "{}")],
    ),
    (
        "pythonic",
        '[run_code(language="python", code="""print([1, 2])  # ]\n\'"\'""")]',
        "",
        [("run_code", '{"language": "python", "code": "print([1, 2])  # ]\\n\'\\"\'"}')],
    ),
    ("pythonic", "[add(1, 2)]", "[add(1, 2)]", []),
    ("pythonic", "[add(a=x, b=2)]", "[add(a=x, b=2)]", []),
    ("pythonic", '[launch_rocket(target="moon")]', '[launch_rocket(target="moon")]', []),
    ("pythonic", "[1] See the appendix.", "[1] See the appendix.", []),
    ("pythonic", "[add(a=1, b=2), 3]", "[add(a=1, b=2), 3]", []),
]


@pytest.mark.parametrize(
    "name, text, content, calls", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)]
)
def test_format(name, text, content, calls):
    """Exactly the spec's content and calls, for the whole output and every split of it."""
    parser, reset = make(name)
    got = check_streaming(name, text, TOOL_LIST, parser, reset)
    assert got == ParsedOutput(content, _calls(*calls))
    for call in got.calls:  # complete arguments are JSON that validates
        if call.arguments.endswith("}"):
            jsonschema.validate(json.loads(call.arguments), BY_NAME[call.name].parameters)
    if calls:
        assert parser.detect(text)


@pytest.mark.parametrize("name", BUILTINS)
def test_streamed_shape(name):
    """Content before a call streams before it is complete; the call's first delta carries id
    and name, the arguments follow in pieces; OpenAI deltas merge them per call."""
    parser, reset = make(name)
    calls = [ToolCall(*PARIS, "call_0"), ToolCall(*ADD, "call_1")]
    text = parser.format_calls(calls)
    events = stream_events(parser, list(text), TOOL_LIST)
    deltas = [e for e in events if isinstance(e, ToolCallDelta)]
    assert [(d.index, d.id, d.name) for d in deltas if d.id] == [
        (0, "call_0", "get_weather"),
        (1, "call_1", "add"),
    ]
    if name != "pythonic":  # JSON arguments stream as they are generated
        assert sum(1 for d in deltas if d.index == 0 and d.arguments) > 5
    assert fold_events(events) == ParsedOutput("", calls)
    assert openai_delta(events) == {
        "tool_calls": [
            {
                "index": 0,
                "id": "call_0",
                "type": "function",
                "function": {"name": PARIS[0], "arguments": PARIS[1]},
            },
            {
                "index": 1,
                "id": "call_1",
                "type": "function",
                "function": {"name": ADD[0], "arguments": ADD[1]},
            },
        ]
    }
    assert openai_delta([]) == {}
    assert openai_delta([ContentDelta("a"), ContentDelta("b"), ToolCallDelta(0, "{}")]) == {
        "content": "ab",
        "tool_calls": [{"index": 0, "function": {"arguments": "{}"}}],
    }


def test_content_streams_before_the_call_completes():
    parser, _ = make("hermes")
    s = parser.streaming(TOOL_LIST)
    assert s.feed("Let me look.\n<tool_") == [ContentDelta("Let me look.")]
    assert s.feed('call>\n{"name": "get_weather", "arg') == []
    first = s.feed('uments": {"city"')
    assert first == [ToolCallDelta(0, "", "call_0", "get_weather"), ToolCallDelta(0, '{"city"')]
    assert s.feed(': "Oslo"}}\n</tool_call>') == [ToolCallDelta(0, ': "Oslo"}')]
    assert s.finish() == []


def test_call_ids_have_openais_shape():
    ids = {new_call_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", i) for i in ids)
    call = HermesParser().parse(
        '<tool_call>{"name": "add", "arguments": {}}</tool_call>', TOOL_LIST
    )
    assert re.fullmatch(r"call_[A-Za-z0-9]{24}", call.calls[0].id)
    assert call.calls[0].openai() == {
        "id": call.calls[0].id,
        "type": "function",
        "function": {"name": "add", "arguments": "{}"},
    }


# ---- properties ----------------------------------------------------------------------------


def _cut(text: str, cuts: list[int]) -> list[str]:
    cuts = sorted(cuts)
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


# pieces of text that resemble the formats: random joins of them exercise every state
FRAGMENTS = [
    *"""<tool_call> </tool_call> <tool_ [TOOL_CALLS] [ARGS] [CALL_ID] <|python_tag|>
    <|python_start|> <|python_end|> { } [ ] ( ) " ' \\ , ; : = "name" "arguments" "parameters"
    "add" add get_time {"a":1} a 1 true é 東""".split(),
    " ",
    "\n",
]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(BUILTINS),
    parts=st.lists(st.sampled_from(FRAGMENTS), max_size=25),
    data=st.data(),
)
def test_any_text(name, parts, data):
    """On any text: streaming in random pieces equals parsing it whole, and with no call found
    the content is the text unchanged."""
    text = "".join(parts)
    parser, reset = make(name)
    whole = parser.parse(text, TOOL_LIST)
    pieces = _cut(text, data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    reset()
    assert fold_events(stream_events(parser, pieces, TOOL_LIST)) == whole
    if not whole.calls:
        assert whole.content == text


SIDES = ["", "Sure, one moment.", "Résumé: 東京 ✓", "Answer follows"]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(BUILTINS),
    defs=st.lists(st.sampled_from(TOOL_DEFS), min_size=1, max_size=3),
    before=st.sampled_from(SIDES),
    after=st.sampled_from(SIDES),
    data=st.data(),
)
def test_calls_among_content(name, defs, before, after, data):
    """Calls written in the format, with content around them where the format allows it,
    parse back exactly (arguments validating against each tool's schema), however split."""
    parser, reset = make(name)
    calls = [
        ToolCall(d.name, json.dumps(d.valid, ensure_ascii=False), f"call_{i}")
        for i, d in enumerate(defs)
    ]
    body = parser.format_calls(calls)
    if name == "llama3" and before:
        body = "<|python_tag|>" + body
    if name == "pythonic" and before:
        body = "<|python_start|>" + body + "<|python_end|>"
    if name in ("llama3", "pythonic"):
        after = ""  # these formats end the message with the calls
    text = (before + "\n" if before else "") + body + ("\n" + after if after else "")
    expected = "\n".join(s for s in (before, after) if s)
    pieces = _cut(text, data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    got = fold_events(stream_events(parser, pieces, TOOL_LIST))
    reset()
    assert parser.parse(text, TOOL_LIST) == got
    assert got.content == expected
    assert [c.name for c in got.calls] == [d.name for d in defs]
    for call, d in zip(got.calls, defs, strict=True):
        args = json.loads(call.arguments)
        assert args == d.valid
        jsonschema.validate(args, d.parameters)


# ---- the family ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", plugins.names("tool_call_parser"))
def test_tool_call_parser_kit(name):
    check_tool_call_parser(name)


def test_kit_catches_a_parser_that_leaks_markers():
    """A stream that passes text straight through (no holding back) fails the kit."""

    class PassThrough(ToolCallStream):
        def feed(self, text):
            return [ContentDelta(text)] if text else []

        def finish(self):
            return []

    class Leaky(HermesParser):
        def streaming(self, tools):
            return PassThrough()

        def parse(self, text, tools):
            return HermesParser(self.id_factory).parse(text, tools)

    plugins.register("tool_call_parser", "leaky_for_test", Leaky)
    try:
        with pytest.raises(AssertionError, match="leaky_for_test"):
            check_tool_call_parser("leaky_for_test")
    finally:
        plugins.unregister("tool_call_parser", "leaky_for_test")


def test_builtins_are_registered():
    assert plugins.FAMILIES["tool_call_parser"].flag == "--tool-call-parser"
    for name in (*BUILTINS, "qwen", "qwen25"):
        cls = plugins.resolve("tool_call_parser", name)
        assert issubclass(cls, ToolCallParser)
    assert plugins.resolve("tool_call_parser", "qwen25") is HermesParser


# ---- auto: the parser from the chat template's source --------------------------------------

# excerpts of the real templates: the lines that show each family's tool-call format
QWEN25 = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}...For each function call, return a json "
    "object with function name and arguments within <tool_call></tool_call> XML tags:\\n"
    '<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n'
    "</tool_call><|im_end|>\\n' }}"
)
LLAMA31 = (
    '{{- "Environment: ipython\\n" }}...{{- \'Respond in the format {"name": function name, '
    '"parameters": dictionary of argument name and its value}. \' }}...{%- if '
    "builtin_tools is defined and tool_call.name in builtin_tools %}{{- '<|python_tag|>' + "
    "tool_call.name + '.call(' }}"
)
LLAMA32_PYTHONIC = (
    "{{- 'Respond in the format [func_name1(params_name1=params_value1, "
    "params_name2=params_value2...), func_name2(params)] ' }}{{- '<|python_tag|>' }}"
)
LLAMA4 = "{{- '<|header_start|>assistant<|header_end|>\\n\\n' -}}{{- '<|python_start|>' }}"
MISTRAL = (
    '{{- "[AVAILABLE_TOOLS] [" }}...{{- "[TOOL_CALLS] [" }}{%- for tool_call in '
    "message.tool_calls %}"
)
# SmolLM2-135M-Instruct's (the default model): no tools
SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.mark.parametrize(
    "template, expected",
    [
        (QWEN25, "hermes"),
        (LLAMA31, "llama3"),
        (LLAMA32_PYTHONIC, "pythonic"),  # outranks the tag that llama3 also looks for
        (LLAMA4, "pythonic"),
        (MISTRAL, "mistral"),
        (SMOLLM2, None),
        (None, None),
        ("", None),
    ],
)
def test_parser_for_template(template, expected):
    assert parser_for_template(template) == expected
    if expected is not None:
        parser = make_tool_call_parser("auto", template)
        assert type(parser) is plugins.resolve("tool_call_parser", expected)


def test_auto_without_a_match_says_what_to_do():
    with pytest.raises(ValueError, match="shows no tool-call format") as err:
        make_tool_call_parser("auto", SMOLLM2)
    msg = str(err.value)
    assert "'<tool_call>'" in msg and "'[TOOL_CALLS]'" in msg
    assert "--tool-call-parser {hermes,llama3,mistral,pythonic" in msg
    with pytest.raises(ValueError, match="has no chat template"):
        make_tool_call_parser("auto", None)
    with pytest.raises(plugins.RegistryError, match="hermes"):
        make_tool_call_parser("nope")
    assert isinstance(make_tool_call_parser("mistral", SMOLLM2), ToolCallParser)


def test_a_plugin_parser_joins_auto():
    """auto asks every registered parser (no list of names): a plug-in that ranks itself
    higher for a template wins it."""

    class Custom(HermesParser):
        template_signals = ("<my_tool>",)
        template_priority = 50

    plugins.register("tool_call_parser", "custom_for_test", Custom)
    try:
        assert parser_for_template(QWEN25 + "<my_tool>") == "custom_for_test"
        assert parser_for_template(QWEN25) == "hermes"
    finally:
        plugins.unregister("tool_call_parser", "custom_for_test")
