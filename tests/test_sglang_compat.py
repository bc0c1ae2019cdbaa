"""SGLang compatibility of the native API (issue 24): SGLang's own serialised logit processors
(its real ``CustomLogitProcessor`` class, ``to_str()`` payloads as its client sends them),
``stop_regex`` and ``stop_token_ids`` against formulas on the unstopped greedy text, every field
of SGLang's ``GenerateReqInput`` and ``SamplingParams`` accepted or refused by name.

SGLang is installed without its dependencies (``make setup``). Its ``custom_logit_processor``
module needs only dill, orjson and torch, but ``import sglang`` runs ``sglang/__init__.py``,
which imports SGLang's whole runtime (IPython, PIL, msgspec, ...) and patches transformers; the
tests import the module under its real name through a bare ``sglang`` package object instead, so
dill pickles its classes by reference exactly as in an SGLang client.
"""

from __future__ import annotations

import ast
import asyncio
import importlib
import importlib.util
import json
import pathlib
import random
import re
import sys
import types

import httpx
import pytest

import loom
from loom.sampling.sampling_params import UNSUPPORTED, SamplingParams
from loom.sampling.stop_regex import compile_stop_regex
from loom.server.generate_fields import GENERATE_FIELDS, NO_EFFECT, REFUSED
from tests.conftest import chat_ids, http_post, http_stream

QUESTION = "What is the capital of France?"  # SmolLM2 greedy: "The capital of France is Paris."


def sglang_module(name: str) -> types.ModuleType:
    """An SGLang module imported without running ``sglang/__init__.py``."""
    if "sglang" not in sys.modules:
        spec = importlib.util.find_spec("sglang")
        if spec is None:  # (`make setup` installs it where a wheel exists: Python >= 3.11)
            pytest.skip("sglang is not installed (make setup: pip install --no-deps sglang)")
        pkg = types.ModuleType("sglang")
        pkg.__path__ = list(spec.submodule_search_locations)
        pkg.__spec__ = spec
        sys.modules["sglang"] = pkg
    return importlib.import_module(name)


def sglang_source(rel: str) -> str:
    sglang_module("sglang")
    return (pathlib.Path(sys.modules["sglang"].__path__[0]) / rel).read_text()


@pytest.fixture(scope="module")
def clp():
    return sglang_module("sglang.srt.sampling.custom_logit_processor")


# Client code, as a user writes it in their script (__main__): dill pickles these classes by
# value and SGLang's base class by reference.
CLIENT = '''
class ForceTokens(CustomLogitProcessor):
    """SGLang's docs' DeterministicLogitProcessor, generalised: the next token is
    custom_params["token_ids"][len(output so far)], read through __req__."""

    def __call__(self, logits, custom_param_list=None):
        assert logits.shape[0] == len(custom_param_list)
        for i, params in enumerate(custom_param_list):
            req = params["__req__"]
            script = params["token_ids"]
            logits[i, :] = -float("inf")
            logits[i, script[len(req.output_ids) % len(script)]] = 0.0
        return logits


class ReadsReq(CustomLogitProcessor):
    """Forces 100 + prompt length + output length + its instance count, and checks the rest
    of __req__ and that its params dict is the same across steps (it counts its calls)."""

    instances = 0

    def __init__(self):
        type(self).instances += 1

    def __call__(self, logits, custom_param_list=None):
        for i, params in enumerate(custom_param_list):
            req = params["__req__"]
            if req.rid != params["rid"] or req.sampling_params.max_new_tokens != params["max"]:
                raise ValueError("__req__ does not describe the request")
            params["calls"] = params.get("calls", 0) + 1
            if params["calls"] != len(req.output_ids) + 1 or req.finished():
                raise ValueError("custom_params is not the request's own dict")
            n = len(req.origin_input_ids) + len(req.output_ids) + type(self).instances
            logits[i, :] = -float("inf")
            logits[i, 100 + n] = 0.0
        return logits
'''


def client_payload(clp, name: str) -> str:
    ns = {"__name__": "__main__", "CustomLogitProcessor": clp.CustomLogitProcessor}
    exec(CLIENT, ns)
    return ns[name].to_str()


@pytest.fixture(scope="module")
def server():
    from tests.test_server import Server

    s = Server("--enable-custom-logit-processor")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def engine_on():
    with loom.Engine(max_total_tokens=8192, enable_custom_logit_processor=True) as e:
        yield e


@pytest.fixture(scope="module")
def ref(engine_on):
    """The question's chat prompt ids and its unstopped greedy output (ids, text)."""
    ids = chat_ids(engine_on, QUESTION)
    out = engine_on.generate(
        input_ids=ids, sampling_params={"max_new_tokens": 16, "temperature": 0}
    )
    assert out["text"] == "The capital of France is Paris."
    return ids, out["output_ids"], out["text"]


def generate(server, **body):
    return http_post(server.url + "/generate", json=body, timeout=120)


# ---- SGLang's custom logit processors ------------------------------------------------------


def test_sglang_payload_top_level_of_generate(server, clp):
    payload = client_payload(clp, "ForceTokens")
    scripts = [[42, 43, 44], [7]]
    r = generate(
        server,
        text=["Hello", "Once upon a time"],
        sampling_params=[
            {"max_new_tokens": 5, "custom_params": {"token_ids": s}, "ignore_eos": True}
            for s in scripts
        ],
        custom_logit_processor=payload,  # top-level, as SGLang's client sends it
    )
    assert r.status_code == 200, r.text
    for out, script in zip(r.json(), scripts, strict=True):
        assert out["output_ids"] == [script[j % len(script)] for j in range(5)]
    # SGLang's own processor, sent by reference: Loom's stand-in for SGLang's module runs it
    first = generate(server, text="Hello", sampling_params={"max_new_tokens": 1, "temperature": 0})
    banned = first.json()["output_ids"][0]
    r = generate(
        server,
        text="Hello",
        sampling_params={
            "max_new_tokens": 1,
            "temperature": 0,
            "custom_params": {"token_ids": [banned]},
        },
        custom_logit_processor=clp.DisallowedTokensLogitsProcessor.to_str(),
    )
    assert r.status_code == 200 and r.json()["output_ids"][0] != banned


def test_sglang_payload_through_the_engine(engine_on, clp):
    payload = client_payload(clp, "ReadsReq")
    prompt = [1, 2, 3, 4, 5]
    params = {"max_new_tokens": 4, "ignore_eos": True, "custom_params": {"rid": "r1", "max": 4}}
    out = engine_on.generate(
        input_ids=prompt, sampling_params=params, rid="r1", custom_logit_processor=payload
    )
    # instantiated once for the payload: its count stays 1 for this and every later request
    assert out["output_ids"] == [100 + len(prompt) + j + 1 for j in range(4)]

    async def both():
        return await engine_on.async_generate(
            input_ids=[prompt, prompt[:2]],
            sampling_params=[
                {**params, "custom_params": {"rid": f"b_{i}", "max": 4}} for i in range(2)
            ],
            rid="b",  # a batch's rid is a prefix, as in SGLang
            custom_logit_processor=payload,
        )

    outs = asyncio.run(both())
    assert outs[0]["output_ids"] == out["output_ids"]
    assert outs[1]["output_ids"] == [100 + 2 + j + 1 for j in range(4)]
    # a processor that raises fails its own request
    bad = engine_on.generate(
        input_ids=prompt,
        sampling_params={**params, "custom_params": {"rid": "other", "max": 4}},
        custom_logit_processor=payload,
    )
    assert "__req__ does not describe the request" in bad["meta_info"]["error"]


def test_serialised_processors_are_refused_when_the_flag_is_off(engine, clp):
    from loom.server.app import create_app

    payload = client_payload(clp, "ForceTokens")
    unloadable = json.dumps({"callable": "00"})  # refused before anything is unpickled
    for p in (payload, unloadable):
        with pytest.raises(ValueError, match="--enable-custom-logit-processor"):
            engine.generate("Hi", {"custom_params": {"token_ids": [1]}}, custom_logit_processor=p)
    app = create_app(engine)  # the HTTP routes over this (flag-off) engine, in process
    try:

        async def post():
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://loom") as c:
                return await c.post(
                    "/generate", json={"text": "Hi", "custom_logit_processor": payload}
                )

        r = asyncio.run(post())
    finally:
        engine.metrics = None
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "custom_logit_processor"
    assert "--enable-custom-logit-processor" in err["message"]


def test_bad_payloads_are_refused_by_name(server):
    for payload in ('{"callable": "zz"}', json.dumps({"callable": "80049500"})):
        r = generate(server, text="Hi", custom_logit_processor=payload)
        assert r.status_code == 400 and r.json()["error"]["param"] == "custom_logit_processor"
    # beside sampling_params and in it, differently
    r = generate(
        server,
        text="Hi",
        sampling_params={"custom_logit_processor": "disallowed_tokens"},
        custom_logit_processor="no_repeat_ngram",
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "custom_logit_processor"


# ---- stops -----------------------------------------------------------------------------------


def _first_match(pattern: str, text: str) -> re.Match:
    """The oracle: the match in the shortest prefix of ``text`` that has one."""
    for e in range(1, len(text) + 1):
        m = re.search(pattern, text[:e])
        if m is not None:
            return m
    raise AssertionError(f"{pattern!r} never matches {text!r}")


@pytest.mark.parametrize("pattern", [r"[A-Z][a-z]+s\b", r"ital|France", r"\s[a-z]{2}\s"])
def test_stop_regex_ends_the_text_at_the_first_match(server, ref, pattern):
    ids, _, text = ref
    m = _first_match(pattern, text)
    sp = {"max_new_tokens": 16, "temperature": 0, "stop_regex": pattern}
    cut = generate(server, input_ids=ids, sampling_params=sp).json()
    assert cut["text"] == text[: m.start()]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    kept = generate(server, input_ids=ids, sampling_params={**sp, "no_stop_trim": True}).json()
    assert kept["text"] == text[: m.end()]
    # a stream holds back what may be trimmed: its deltas add up to the same text
    body = {"input_ids": ids, "sampling_params": sp, "stream": True}
    with http_stream("POST", server.url + "/generate", json=body, timeout=120) as r:
        chunks = [
            json.loads(line[6:])
            for line in r.iter_lines()
            if line.startswith("data: {")  # (SGLang's default: each chunk has all the text)
        ]
    assert all(
        c["text"].startswith(p["text"]) for p, c in zip(chunks[:-1], chunks[1:], strict=True)
    )
    assert chunks[-1]["text"] == cut["text"]


def test_stop_regex_from_sglangs_frontend_shape(server):
    """The sampling_params SGLang's frontend language sends for every sgl.gen."""
    sp = {
        "skip_special_tokens": True,
        "spaces_between_special_tokens": True,
        "max_new_tokens": 4,
        "min_new_tokens": 0,
        "n": 1,
        "stop": [],
        "stop_token_ids": [],
        "stop_regex": [],
        "temperature": 0,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "ignore_eos": False,
        "regex": None,
        "json_schema": None,
    }
    r = generate(server, text="Hello", sampling_params=sp, return_text_in_logprobs=True)
    assert r.status_code == 200, r.text
    r = generate(server, text="Hi", sampling_params={"stop_regex": "(unclosed"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop_regex"


def test_stop_token_ids_are_trimmed_from_the_text(server, engine_on, ref):
    ids, out_ids, text = ref
    k = out_ids.index(engine_on.tokenizer.encode(" Paris", add_special_tokens=False)[0])
    sp = {"max_new_tokens": 16, "temperature": 0, "stop_token_ids": [out_ids[k]]}
    cut = generate(server, input_ids=ids, sampling_params=sp).json()
    assert cut["output_ids"] == out_ids[: k + 1]  # the ids keep the stop token
    assert cut["text"] == engine_on.tokenizer.decode(out_ids[:k]) == "The capital of France is"
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": out_ids[k]}
    kept = generate(server, input_ids=ids, sampling_params={**sp, "no_stop_trim": True}).json()
    assert kept["text"] == "The capital of France is Paris"


def test_stop_regex_search_against_brute_force():
    """Incremental checks on random texts given in random pieces find the match in the
    shortest prefix that has one (the oracle: ``re`` on every prefix), and until then the
    held-back text covers the part of it already there."""
    rng = random.Random(7)
    patterns = [r"ab+c", r"a\b", r"(?<=x)y", r"b$", r"[ab]{2,3}c", r"c|ba", r"(a|b)*c"]
    patterns += [r"ab(?=c)", r"a(?!b)", r"(?m)x$", r"\bc", r"y\s*$"]
    for _ in range(500):
        pattern = rng.choice(patterns)
        text = "".join(rng.choice("abcxy \n") for _ in range(rng.randrange(1, 30)))
        e = next((e for e in range(1, len(text) + 1) if re.search(pattern, text[:e])), None)
        want = None if e is None else re.search(pattern, text[:e]).span()
        sr = compile_stop_regex(pattern)
        got, checked, pos = None, 0, 0
        while pos < len(text) and got is None:
            pos = min(len(text), pos + rng.randrange(1, 5))
            got = sr.first_match(text[:pos], checked)
            if got is None:
                held = sr.partial_start(text[:pos], pos)
                if want is not None and want[0] < pos:  # the match has begun
                    assert held is not None and held <= want[0], (pattern, text[:pos])
                checked = pos
        assert got == want, (pattern, text)


# ---- SGLang's request fields ---------------------------------------------------------------


def _dataclass_fields(source: str, cls: str, stop_at: str | None = None) -> list[str]:
    tree = ast.parse(source)
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    names = []
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            if stmt.target.id == stop_at:
                break
            names.append(stmt.target.id)
    return names


def test_every_generate_req_input_field_is_accepted_or_refused_by_name(server):
    fields = _dataclass_fields(sglang_source("srt/managers/io_struct.py"), "GenerateReqInput")
    assert len(fields) > 60 and set(fields) == set(GENERATE_FIELDS)
    base = {"text": "Hi", "sampling_params": {"max_new_tokens": 1}}
    refused = [name for name, (kind, _) in GENERATE_FIELDS.items() if kind == REFUSED]
    for name in refused:
        r = generate(server, **{**base, name: True})
        assert r.status_code == 400 and r.json()["error"]["param"] == name, (name, r.text)
    # what asks for nothing is accepted, and so is every field that has no effect
    neutral = {name: None for name in refused}
    neutral |= {"routed_dp_rank": 0, "image_data": [None], "return_hidden_states": False}
    no_effect = {name: "x" for name, (kind, _) in GENERATE_FIELDS.items() if kind == NO_EFFECT}
    r = generate(server, **base, **neutral, **no_effect)
    assert r.status_code == 200, r.text
    r = generate(server, **base, a_field_sglang_lacks=1)
    assert r.status_code == 400 and r.json()["error"]["param"] == "a_field_sglang_lacks"


def test_every_sglang_sampling_param_is_accepted_or_refused_by_name():
    fields = _dataclass_fields(
        sglang_source("srt/sampling/sampling_params.py"), "SamplingParams", stop_at="stop_strs"
    )
    assert "stop_regex" in fields and "custom_params" in fields
    ours = set(SamplingParams.__dataclass_fields__)
    for name in fields:
        assert name in ours or name in UNSUPPORTED, name
    for name in UNSUPPORTED:
        with pytest.raises(ValueError) as e:
            SamplingParams.from_dict({name: 2})
        assert e.value.param == name
        assert SamplingParams.from_dict({name: None}) == SamplingParams()


def test_logprob_texts_prompt_ids_and_stream_interval(server, engine_on, ref):
    ids, out_ids, _ = ref
    sp = {"max_new_tokens": 7, "temperature": 0}
    body = {"input_ids": ids, "sampling_params": sp, "return_logprob": True}
    plain = generate(server, **body).json()["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in plain] == out_ids[:7] and all(s is None for _, _, s in plain)
    full = generate(server, **body, return_text_in_logprobs=True, return_prompt_token_ids=True)
    out = full.json()
    texts = [s for _, _, s in out["meta_info"]["output_token_logprobs"]]
    assert texts == [engine_on.tokenizer.decode([t]) for t in out_ids[:7]]
    assert out["prompt_token_ids"] == ids
    # SGLang's stream_interval: the first token at once, then every 3, then the rest
    body = {"input_ids": ids, "sampling_params": {**sp, "stream_interval": 3}, "stream": True}
    with http_stream("POST", server.url + "/generate", json=body, timeout=120) as r:
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    counts = [len(c["output_ids"]) for c in chunks]  # (each chunk has all the ids so far)
    assert counts[0] == 1 and counts[-1] == 7
    assert all(b - a >= 3 for a, b in zip(counts[:-2], counts[1:-1], strict=True))


def test_token_ids_logprob_one_list_per_prompt(server, engine_on, ref):
    """SGLang's ``token_ids_logprob`` for a batch, one list per prompt: every output and prompt
    position reports those ids, in their order, equal to the engine's own logprobs."""
    ids, out_ids, _ = ref
    prompts = [ids, ids[:-2]]
    probes = [[out_ids[0], 0, 42], [7]]
    sp = {"max_new_tokens": 3, "temperature": 0}
    body = {"input_ids": prompts, "sampling_params": sp, "return_logprob": True}
    got = generate(server, **body, logprob_start_len=len(ids) - 4, token_ids_logprob=probes).json()
    for prompt, probe, r in zip(prompts, probes, got, strict=True):
        meta = r["meta_info"]
        want = engine_on.generate(
            input_ids=prompt,
            sampling_params=sp,
            return_logprob=True,
            logprob_start_len=len(ids) - 4,
            token_ids_logprob=probe,
        )["meta_info"]
        for key in ("output_token_ids_logprobs", "input_token_ids_logprobs"):
            assert len(meta[key]) == len(want[key]) > 0
            for row, ref_row in zip(meta[key], want[key], strict=True):
                assert [t for _, t, _ in row] == probe
                assert [v for v, _, _ in row] == pytest.approx([v for v, _, _ in ref_row], abs=1e-3)
    # the sampled token's own logprob, seen both ways
    first = got[0]["meta_info"]
    assert first["output_token_ids_logprobs"][0][0][0] == pytest.approx(
        first["output_token_logprobs"][0][0], abs=1e-5
    )
    # one flat list serves every prompt; a bad id or a list per prompt of the wrong length
    # is a 400 naming the field
    flat = generate(server, **body, token_ids_logprob=[5, 6]).json()
    assert all(
        [t for _, t, _ in r["meta_info"]["output_token_ids_logprobs"][0]] == [5, 6] for r in flat
    )
    for bad in ([[1], [2], [3]], [1 << 40], [[1], ["x"]]):
        r = generate(server, **body, token_ids_logprob=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "token_ids_logprob", bad


def test_null_fields_take_sglangs_defaults(engine):
    ids, params = engine._prepare(None, [1, 2, 3], {"max_new_tokens": None, "temperature": None})
    assert params.max_new_tokens == engine.context_len - 3  # what the context leaves
    assert params.temperature == 1.0
    assert SamplingParams.from_dict({"regex": "", "json_schema": ""}).constraint is None
