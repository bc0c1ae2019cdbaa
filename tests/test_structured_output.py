"""Structured output on SmolLM2: every output validates (jsonschema) for xgrammar and
llguidance, greedy and sampled, in batches mixed with unconstrained requests whose outputs equal
their outputs alone; regex and EBNF outputs fully match; the reasoner frees output until the
think-end token; bad constraints are refused."""

from __future__ import annotations

import importlib.util
import json
import re

import jsonschema
import pytest
import torch

import loom
from loom import plugins
from loom.bench.json_schemas import SCHEMAS
from loom.testing import check_grammar_backend
from tests.conftest import CHAT_PROMPTS, chat_ids
from tests.test_sampler import patch_triton_language_once

BACKENDS = ["xgrammar", "llguidance"]
FREE = {"max_new_tokens": 24, "temperature": 0}


def _validate(text: str, schema: dict) -> None:
    jsonschema.validate(
        json.loads(text), schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
    )


@pytest.fixture(scope="module", params=BACKENDS)
def gengine(request):
    with loom.Engine(grammar_backend=request.param, max_total_tokens=32768) as e:
        yield e


@pytest.fixture(scope="module")
def free_reference(engine):
    return [
        engine.generate(input_ids=chat_ids(engine, p), sampling_params=FREE)["output_ids"]
        for p in CHAT_PROMPTS[:3]
    ]


@pytest.mark.parametrize("name", BACKENDS)
def test_grammar_backend_kit(engine, name):
    check_grammar_backend(name, engine.tokenizer, engine.vocab_size, sorted(engine.eos_token_ids))


def test_reasoner_matcher_states(engine):
    """Free while thinking (row untouched), forced think-end after the budget, then the inner
    grammar; rollback across the boundary and copies restore/keep state."""
    from loom.constrained.reasoner import ReasonerBackend

    tok = engine.tokenizer
    b = ReasonerBackend(
        tok,
        engine.vocab_size,
        sorted(engine.eos_token_ids),
        think_end_token="</think>",
        think_budget=3,
    )
    end = b.end_ids
    m = b.matcher(b.compile("regex", "[0-9]+"))
    mask = b.allocate_vocab_mask(2)
    b.reset_vocab_mask(mask)
    m.fill_vocab_mask(mask, 0)
    assert (mask == -1).all()  # thinking: everything allowed
    hello = tok.encode(" hello there friend", add_special_tokens=False)[:3]
    for t in hello:
        assert m.accept_token(t)
    snap = m.copy()
    b.reset_vocab_mask(mask)
    m.fill_vocab_mask(mask, 1)
    allowed = [int(i) for i in (mask[1].to(torch.int64) & 0xFFFFFFFF).nonzero()]
    assert len(allowed) == 1 and int(mask[1, end[0] // 32]) != 0  # only the think-end id
    assert not m.accept_token(hello[0])
    for t in end:
        assert m.accept_token(t)
    assert not m.accept_token(tok.encode("abc", add_special_tokens=False)[0])  # grammar now
    assert m.accept_token(tok.encode("7", add_special_tokens=False)[0])
    m.rollback(len(end) + 1)
    row = b.allocate_vocab_mask(1)
    m.fill_vocab_mask(row, 0)
    other = b.allocate_vocab_mask(1)
    snap.fill_vocab_mask(other, 0)
    assert torch.equal(row, other)


def _allowed(backend, matcher):
    mask = backend.allocate_vocab_mask(1)
    backend.reset_vocab_mask(mask)
    matcher.fill_vocab_mask(mask, 0)
    bits = mask[0].to(torch.int64) & 0xFFFFFFFF
    return lambda t: bool((int(bits[t // 32]) >> (t % 32)) & 1)


def test_reasoner_start_state_follows_the_prompt(engine):
    """With a preset, a prompt whose tail opened the thoughts starts them; any other prompt
    lets the output choose where the think-start marker is one token (as Qwen3's is): that
    token opens them, any other first token is the grammar's (and the mask allows both)."""
    import copy

    from loom.constrained.reasoner import ReasonerBackend

    tok = copy.deepcopy(engine.tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    b = ReasonerBackend(tok, len(tok), sorted(engine.eos_token_ids), reasoning_parser="qwen3")
    compiled = b.compile("regex", "[0-9]+")
    digit = tok.encode("7", add_special_tokens=False)[0]
    letter = tok.encode("abc", add_special_tokens=False)[0]
    (start,) = b.start_ids

    inside = b.matcher_for(compiled, tok.encode("<|im_start|>assistant\n<think>\n"))
    assert _allowed(b, inside)(letter)  # thinking: free
    assert inside.accept_token(letter) and not inside.is_terminated()

    closed = tok.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    for prompt in (closed, tok.encode("<|im_start|>assistant\n")):
        m = b.matcher_for(compiled, prompt)
        ok = _allowed(b, m)
        assert ok(digit) and ok(start) and not ok(letter)
        assert not m.accept_token(letter)
        answer = m.copy()
        assert answer.accept_token(digit) and not answer.accept_token(letter)  # the grammar
        assert m.accept_token(start)  # the output opens its thoughts
        assert m.accept_token(letter)  # free
        for t in b.end_ids:
            assert m.accept_token(t)
        assert not m.accept_token(letter) and m.accept_token(digit)
        m.rollback(1 + 1 + len(b.end_ids) + 1)  # back to the undecided start
        assert _allowed(b, m)(start) and m.accept_token(digit)


def test_reasoner_with_a_multi_token_start_marker(engine):
    """Where "<think>" is several tokens, a prompt that opened no thoughts is the answer from
    its first token: the marker's first id ("<") is not let through for it."""
    from loom.constrained.reasoner import ReasonerBackend

    tok = engine.tokenizer
    b = ReasonerBackend(
        tok, engine.vocab_size, sorted(engine.eos_token_ids), reasoning_parser="qwen3"
    )
    assert len(tok.encode("<think>", add_special_tokens=False)) > 1 and b.start_ids == []
    compiled = b.compile("regex", "[0-9]+")
    m = b.matcher_for(compiled, tok.encode("<|im_start|>assistant\n"))
    first = tok.encode("<think>", add_special_tokens=False)[0]
    assert not _allowed(b, m)(first) and not m.accept_token(first)
    assert m.accept_token(tok.encode("7", add_special_tokens=False)[0])
    inside = b.matcher_for(compiled, tok.encode("<|im_start|>assistant\n<think>\n"))
    assert inside.accept_token(first)


def test_reasoning_parser_wraps_the_grammar_backend():
    """--reasoning-parser alone puts the reasoner around the default backend: a prompt that
    opened no thoughts is constrained from the first token; one that did is free until the
    think-end."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    with loom.Engine(reasoning_parser="qwen3", max_total_tokens=8192) as e:
        plain = chat_ids(e, "Give me a JSON object.")
        thinking = plain + e.tokenizer.encode("<think>\n", add_special_tokens=False)
        params = {"max_new_tokens": 24, "temperature": 0, "json_schema": json.dumps(schema)}
        outs = e.generate(input_ids=[plain, thinking], sampling_params=params)
        free = e.generate(input_ids=thinking, sampling_params={**params, "json_schema": None})
    _validate(outs[0]["text"], schema)
    assert outs[1]["output_ids"] == free["output_ids"]


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_json_schemas_validate_in_a_mixed_batch(gengine, free_reference, mode):
    e = gengine
    ids, params = [], []
    for i, (task, schema) in enumerate(SCHEMAS):
        ids.append(chat_ids(e, f"{task} Answer with a JSON object only."))
        p = {"max_new_tokens": 256, "json_schema": json.dumps(schema)}
        p.update(
            {"temperature": 0}
            if mode == "greedy"
            else {"temperature": 0.7, "top_p": 0.95, "seed": i}
        )
        params.append(p)
    free_ids = [chat_ids(e, p) for p in CHAT_PROMPTS[:3]]
    # unconstrained neighbours interleaved with the constrained requests
    order = list(range(len(ids)))
    batch_ids = ids[:10] + free_ids[:1] + ids[10:20] + free_ids[1:] + ids[20:]
    batch_params = params[:10] + [FREE] + params[10:20] + [FREE, FREE] + params[20:]
    outs = e.generate(input_ids=batch_ids, sampling_params=batch_params)
    constrained = outs[:10] + outs[11:21] + outs[23:]
    free = [outs[10], outs[21], outs[22]]
    for i, out in zip(order, constrained, strict=True):
        assert out["meta_info"]["finish_reason"]["type"] == "stop", (i, out)
        _validate(out["text"], SCHEMAS[i][1])
    assert [o["output_ids"] for o in free] == free_reference


@pytest.mark.parametrize(
    "pattern",
    [
        r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
        r"\+1 [0-9]{3}-[0-9]{3}-[0-9]{4}",
    ],
    ids=["iso-date", "phone"],
)
def test_regex_outputs_fully_match(gengine, pattern):
    e = gengine
    prompt = chat_ids(e, "When was the Eiffel Tower finished, and what is a phone number?")
    for params in ({"temperature": 0}, {"temperature": 1.0, "seed": 7}):
        out = e.generate(
            input_ids=prompt, sampling_params={"max_new_tokens": 40, "regex": pattern, **params}
        )
        assert re.fullmatch(pattern, out["text"]), out["text"]


ARITH = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= num | "(" expr ")"
num ::= [0-9]+
"""


def test_ebnf_arithmetic(gengine):
    e = gengine
    out = e.generate(
        input_ids=chat_ids(e, "Write an arithmetic expression that equals 10."),
        sampling_params={"max_new_tokens": 40, "temperature": 0, "ebnf": ARITH},
    )
    text = out["text"]
    assert re.fullmatch(r"[0-9+\-*/()]+", text) and text
    # a full parse: Python evaluates exactly this grammar's language (integers, + - * /, parens)
    eval(compile(text, "<expr>", "eval"), {"__builtins__": {}})  # noqa: S307


def test_bad_constraints_are_refused_and_the_engine_keeps_serving(gengine):
    e = gengine
    ids = chat_ids(e, "hello")
    for params, match in [
        ({"json_schema": "{not json"}, "json_schema"),
        ({"regex": "(unclosed"}, "regex"),
        ({"ebnf": "root ::= undefined_rule"}, "ebnf"),
        ({"regex": "a", "json_schema": "{}"}, "at most one"),
    ]:
        with pytest.raises(ValueError, match=match):
            e.generate(input_ids=ids, sampling_params={"max_new_tokens": 4, **params})
    # an empty constraint is no constraint (SGLang's rule)
    free = {"max_new_tokens": 4, "temperature": 0}
    assert (
        e.generate(input_ids=ids, sampling_params={**free, "json_schema": ""})["output_ids"]
        == e.generate(input_ids=ids, sampling_params=free)["output_ids"]
    )
    out = e.generate(input_ids=ids, sampling_params={"max_new_tokens": 4, "regex": "yes|no"})
    assert out["text"] in ("yes", "no")


def test_response_format_through_the_http_parser():
    from loom.server.chat_routes import parse_chat
    from loom.server.errors import APIError

    msgs = [{"role": "user", "content": "hi"}]
    req = parse_chat({"messages": msgs, "response_format": {"type": "json_object"}}).req
    assert json.loads(req.sampling["json_schema"]) == {"type": "object"}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    req = parse_chat(
        {
            "messages": msgs,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": schema},
            },
        }
    ).req
    assert json.loads(req.sampling["json_schema"]) == schema
    req = parse_chat({"messages": msgs, "regex": "[a-z]+"}).req
    assert req.sampling["regex"] == "[a-z]+"
    for body in (
        {"response_format": {"type": "json_schema"}},
        {"response_format": {"type": "yaml"}},
        {"response_format": {"type": "json_object"}, "regex": "a"},
    ):
        with pytest.raises(APIError):
            parse_chat({"messages": msgs, **body})


@pytest.mark.parametrize("inner", BACKENDS)
def test_reasoner_frees_thinking_then_applies_the_grammar(inner):
    """A custom think-end string; the budget forces it after 12 free tokens, then the JSON
    schema applies."""
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 100}},
        "required": ["answer"],
    }
    end = " END_OF_THOUGHT"
    with loom.Engine(
        grammar_backend="reasoner",
        reasoner_grammar_backend=inner,
        think_end_token=end,
        think_budget=12,
        max_total_tokens=8192,
    ) as e:
        ids = chat_ids(e, "What is 6 times 7? Think, then answer in JSON.")
        outs = e.generate(
            input_ids=[ids, ids],
            sampling_params=[
                {"max_new_tokens": 80, "temperature": 0, "json_schema": json.dumps(schema)},
                {
                    "max_new_tokens": 80,
                    "temperature": 0.7,
                    "seed": 3,
                    "json_schema": json.dumps(schema),
                },
            ],
        )
        free = e.generate(input_ids=ids, sampling_params={"max_new_tokens": 12, "temperature": 0})
    for out in outs:
        thought, sep, rest = out["text"].partition(end.strip())
        assert sep, out["text"]
        _validate(rest.strip(), schema)
    # before the think-end token the text is the model's own (greedy: unconstrained tokens)
    assert outs[0]["output_ids"][:12] == free["output_ids"]


def test_grammar_backend_none_refuses_constraints():
    with loom.Engine(grammar_backend="none", max_total_tokens=4096) as e:
        with pytest.raises(ValueError, match="grammar-backend none"):
            e.generate(prompt="hi", sampling_params={"regex": "a+"})
        assert e.generate(prompt="hi", sampling_params={"max_new_tokens": 2})["output_ids"]


def test_reasoner_needs_a_think_end():
    with pytest.raises(ValueError, match="think-end"):
        loom.Engine(grammar_backend="reasoner")


def test_every_registered_grammar_backend_is_known():
    assert {"xgrammar", "llguidance", "reasoner", "none"} <= set(plugins.names("grammar_backend"))


def test_overlap_with_grammars_and_processors_keeps_outputs(gengine):
    """Under overlap scheduling, constrained and processor rows still chain: the forward of step
    N+1 runs ahead, N is resolved (matchers advance) before N+1 is sampled. Outputs equal the
    non-overlapped ones."""
    e = gengine
    ids, params = [], []
    for task, schema in SCHEMAS[:6]:
        ids.append(chat_ids(e, f"{task} Answer with a JSON object only."))
        params.append({"max_new_tokens": 96, "temperature": 0, "json_schema": json.dumps(schema)})
    for p in CHAT_PROMPTS[:2]:
        ids.append(chat_ids(e, p))
        params.append(
            {
                "max_new_tokens": 24,
                "temperature": 0,
                "custom_logit_processor": "no_repeat_ngram",
                "custom_params": {"n": 2},
            }
        )
    ids.append(chat_ids(e, CHAT_PROMPTS[3]))
    params.append({"max_new_tokens": 24, "temperature": 0})
    sched = e.scheduler
    before = sched.overlap
    try:
        sched.overlap = False
        want = [o["output_ids"] for o in e.generate(input_ids=ids, sampling_params=params)]
        sched.overlap = True
        n0 = sched.stats.num_overlapped_batches
        got = [o["output_ids"] for o in e.generate(input_ids=ids, sampling_params=params)]
        assert sched.stats.num_overlapped_batches > n0 + 10
    finally:
        sched.overlap = before
    assert got == want
    for out_ids, (_, schema) in zip(got[:6], SCHEMAS[:6], strict=True):
        _validate(e.tokenizer.decode(out_ids, skip_special_tokens=True), schema)


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or torch.cuda.is_available(),
    reason="Triton interpreter test (CPU only; tests/gpu runs the kernels on a GPU)",
)
def test_fused_sampling_kernels_apply_the_grammar_mask_end_to_end(
    gengine, free_reference, monkeypatch
):
    """The GPU's sampling path, run on CPU through Triton's interpreter: the grammar bitmask is
    applied by the fused sampling kernels (no library kernel), greedy and sampled rows share the
    batch with an unconstrained neighbour; every constrained output validates and the neighbour
    equals its output alone."""
    import loom.sampling.batch_sampler as sched_mod
    from loom.sampling import triton_sampling

    calls = []
    real = sched_mod.fused_sample

    def counted(*args, **kwargs):
        calls.append(kwargs.get("vocab_mask") is not None)
        return real(*args, **kwargs)

    monkeypatch.setattr(sched_mod, "fused_sampling_enabled", lambda logits: True)
    monkeypatch.setattr(sched_mod, "fused_sample", counted)
    # 2 chunks a row, the second partly masked (49,152 columns): the merges run
    monkeypatch.setattr(triton_sampling, "_CHUNK", 32768)
    patch_triton_language_once(monkeypatch)
    e = gengine
    # two sampled and two greedy rows (sampled: even index), with short outputs (18 to 40
    # tokens): the interpreter's time grows with rows times steps; every schema's grammar is
    # checked with the library's kernel in test_json_schemas_validate_in_a_mixed_batch
    picked = [0, 1, 4, 7]
    ids, params = [], []
    for i in picked:
        task, schema = SCHEMAS[i]
        ids.append(chat_ids(e, f"{task} Answer with a JSON object only."))
        p = {"max_new_tokens": 160, "json_schema": json.dumps(schema)}
        p.update({"temperature": 0} if i % 2 else {"temperature": 0.7, "top_p": 0.95, "seed": i})
        params.append(p)
    ids.insert(2, chat_ids(e, CHAT_PROMPTS[0]))
    params.insert(2, FREE)
    outs = e.generate(input_ids=ids, sampling_params=params)
    assert outs[2]["output_ids"] == free_reference[0]
    del outs[2]
    for out, i in zip(outs, picked, strict=True):
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        _validate(out["text"], SCHEMAS[i][1])
    assert sum(calls) > 15  # the masks went through the fused kernels (19 steps or more here)


def test_masked_argmax_picks_the_first_maximum_among_allowed_tokens():
    """sampler.masked_argmax against a per-token reading of the bitmask (bit t % 32 of word
    t // 32 allows token t), over a vocabulary that is not a multiple of 32, with ties."""
    from loom.sampling.sampler import masked_argmax

    gen = torch.Generator().manual_seed(0)
    bs, vocab = 5, 100
    logits = torch.randint(0, 6, (bs, vocab), generator=gen).float()  # many ties
    words = torch.randint(-(2**31), 2**31 - 1, (bs, 4), generator=gen, dtype=torch.int64)
    mask = words.to(torch.int32)
    mask[2] = -1  # all allowed
    mask[3] = 0
    mask[3, 1] = 1 << 7  # only token 39
    device = "cuda" if torch.cuda.is_available() else "cpu"
    got = masked_argmax(logits.to(device), mask.to(device)).cpu()
    for r in range(bs):
        allowed = [t for t in range(vocab) if (int(mask[r, t // 32]) >> (t % 32)) & 1]
        best = max(logits[r, t].item() for t in allowed)
        assert got[r].item() == next(t for t in allowed if logits[r, t].item() == best)
    assert got[3].item() == 39


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or torch.cuda.is_available(),
    reason="the GPU's sampling choices, forced on CPU (tests/gpu runs them on a GPU)",
)
def test_all_greedy_grammar_batches_take_the_masked_argmax(gengine, free_reference, monkeypatch):
    """On a GPU an all-greedy constrained batch without penalties or bias picks its tokens with
    masked_argmax (PyTorch launches, no Triton one); forced here on CPU: the same tokens as the
    library's mask kernel and argmax, beside an unconstrained greedy neighbour that equals its
    output alone, and every constrained output validates."""
    import loom.sampling.batch_sampler as sched_mod

    e = gengine
    ids = [chat_ids(e, f"{task} Answer with a JSON object only.") for task, _ in SCHEMAS[:4]]
    params = [
        {"max_new_tokens": 160, "temperature": 0, "json_schema": json.dumps(schema)}
        for _, schema in SCHEMAS[:4]
    ]
    ids.insert(1, chat_ids(e, CHAT_PROMPTS[0]))
    params.insert(1, FREE)
    want = e.generate(input_ids=ids, sampling_params=params)  # CPU: the library's kernel
    calls = []
    real = sched_mod.masked_argmax

    def counted(logits, mask):
        calls.append(mask.shape[0])
        return real(logits, mask)

    monkeypatch.setattr(sched_mod, "fused_sampling_enabled", lambda logits: True)
    monkeypatch.setattr(sched_mod, "masked_argmax", counted)
    outs = e.generate(input_ids=ids, sampling_params=params)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in want]
    assert outs[1]["output_ids"] == free_reference[0]
    del outs[1]
    for out, (_, schema) in zip(outs, SCHEMAS[:4], strict=True):
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        _validate(out["text"], schema)
    assert len(calls) > 20 and max(calls) == 5


def test_structural_tag(gengine):
    """xgrammar: a function-call tag whose body is JSON; llguidance refuses it by name."""
    e = gengine
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
    }
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": ["<function="],
            "tags": [
                {
                    "begin": "<function=get_weather>",
                    "content": {"type": "json_schema", "json_schema": schema},
                    "end": "</function>",
                }
            ],
            "at_least_one": True,
            "stop_after_first": True,
        },
    }
    ids = chat_ids(e, "What's the weather in Paris? Call get_weather.")
    params = {"max_new_tokens": 60, "temperature": 0, "structural_tag": json.dumps(tag)}
    if e.server_args.grammar_backend == "llguidance":
        with pytest.raises(ValueError, match="structural_tag"):
            e.generate(input_ids=ids, sampling_params=params)
        return
    text = e.generate(input_ids=ids, sampling_params=params)["text"]
    m = re.fullmatch(r"<function=get_weather>(.*)</function>", text, re.S)
    assert m, text
    _validate(m.group(1), schema)


def test_waiting_for_a_compile_is_not_counted_as_decode_time():
    """A request parked in the grammar queue while nothing else runs: the scheduler's idle
    waits go to ``time_grammar_wait_s``, not to the decode time that benchmarks divide by."""
    import time

    from loom.bench.offline import step_profile
    from loom.constrained.xgrammar_backend import XGrammarBackend

    class SlowCompile(XGrammarBackend):
        def compile(self, kind, text):
            time.sleep(0.5)
            return super().compile(kind, text)

    plugins.register("grammar_backend", "slow_for_test", SlowCompile)
    try:
        with loom.Engine(grammar_backend="slow_for_test", max_total_tokens=4096) as e:
            before = dict(e.get_server_info())
            out = e.generate(
                input_ids=chat_ids(e, "Give me a JSON object."),
                sampling_params={**FREE, "max_new_tokens": 4, "regex": "[a-z]{4}"},
            )
            p = step_profile(before, e.get_server_info())
    finally:
        plugins.unregister("grammar_backend", "slow_for_test")
    assert re.fullmatch("[a-z]{1,4}", out["text"])
    assert p["time_grammar_wait_s"] > 0.2  # the scheduler's own compile, waited for in the queue
    assert p["time_decode_s"] < p["time_grammar_wait_s"]
