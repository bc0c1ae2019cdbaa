"""One request's failure is its own: bounds on every numeric field (the one check in
``loom.sampling.limits``), and failures inside the scheduler (admission, a logits processor, a
grammar matcher, a whole step) that end only the requests they touch, with an error, while the
engine serves everyone else and the KV pool balances."""

from __future__ import annotations

import pytest

from loom import plugins
from loom.sampling.limits import ParamError, check_context, check_number
from loom.sampling.logits_processor import LogitsProcessor

GREEDY = {"max_new_tokens": 6, "temperature": 0}
PROMPTS = ["The capital of France is", "One, two, three,", "The sky is"]

NAN, INF = float("nan"), float("inf")
HOSTILE = [
    ("max_new_tokens", 2**63),
    ("max_new_tokens", -1),
    ("max_new_tokens", 1.5),
    ("max_new_tokens", True),
    ("temperature", NAN),
    ("temperature", INF),
    ("temperature", 10**400),
    ("temperature", "hot"),
    ("top_p", NAN),
    ("top_k", 2**64),
    ("top_k", 0),
    ("min_p", -INF),
    ("frequency_penalty", NAN),
    ("presence_penalty", 10**30),
    ("repetition_penalty", INF),
    ("min_new_tokens", 2**40),
    ("seed", 2**64),
    ("seed", 1.0),
    ("n", 10**6),
    ("stop_token_ids", [2**70]),
    ("stop_token_ids", [-3]),
    ("logit_bias", {"5": NAN}),
    ("logit_bias", {str(10**30): 1.0}),
    ("ignore_eos", "yes"),
]


@pytest.mark.parametrize("field,value", HOSTILE, ids=[f"{f}={str(v)[:12]}" for f, v in HOSTILE])
def test_hostile_sampling_params_are_refused_by_name(engine, field, value):
    with pytest.raises(ValueError) as info:
        engine.generate("Hello", {**GREEDY, field: value})
    err = info.value
    assert isinstance(err, ParamError) and err.param == field, err
    assert field in str(err)
    engine.scheduler.check_kv_balance()


@pytest.mark.parametrize(
    "kwargs,param",
    [
        ({"priority": 2**63}, "priority"),
        ({"priority": NAN}, "priority"),
        ({"return_logprob": True, "top_logprobs_num": 10**9}, "top_logprobs_num"),
        ({"return_logprob": True, "logprob_start_len": 2**63}, "logprob_start_len"),
        ({"return_logprob": "yes"}, "return_logprob"),
        ({"prompt": "Hello \ud800 world"}, "prompt"),
        ({"input_ids": [1, 2**63]}, "input_ids"),
        ({"input_ids": [1, True]}, "input_ids"),
    ],
)
def test_hostile_request_options_are_refused_by_name(engine, kwargs, param):
    kwargs = {"prompt": "Hello", **kwargs}
    if "input_ids" in kwargs:
        kwargs.pop("prompt")
    with pytest.raises(ParamError) as info:
        engine.generate(sampling_params=GREEDY, **kwargs)
    assert info.value.param == param, info.value


def test_lone_surrogate_in_a_chat_message(engine):
    with pytest.raises(ParamError, match=r"messages\[1\]\.content is not valid Unicode"):
        engine.apply_chat_template(
            [{"role": "user", "content": "hi"}, {"role": "user", "content": "a\ud800b"}]
        )


@pytest.mark.parametrize("context_length", [None, 256])
def test_max_new_tokens_beyond_the_context_says_both_numbers(engine, context_length):
    """The message states both numbers, at the model's own context (8192) and a short one; a
    prompt that fills the context but three tokens is run at the short one (prefilling 8,189
    tokens on this CPU takes most of a minute and tests nothing more)."""
    import loom

    e = engine if context_length is None else loom.Engine(context_length=context_length)
    try:
        ids = e.apply_chat_template([{"role": "user", "content": "Hi"}])
        ctx = e.context_len
        for asked in (ctx, 10**12):
            with pytest.raises(ParamError) as info:
                e.generate(input_ids=ids, sampling_params={"max_new_tokens": asked})
            msg = str(info.value)
            assert info.value.param == "max_new_tokens"
            assert f"{ctx} tokens" in msg and f"{len(ids)} in the prompt" in msg
            assert f"at most {ctx - len(ids)} new tokens fit" in msg
        if context_length is None:
            return
        # exactly what fits is accepted; the unasked default is capped silently
        long = [100] * (ctx - 3)
        out = e.generate(input_ids=long, sampling_params={"max_new_tokens": 3, "temperature": 0})
        assert out["meta_info"]["completion_tokens"] <= 3
        out = e.generate(input_ids=long, sampling_params={"temperature": 0, "ignore_eos": True})
        assert out["meta_info"]["completion_tokens"] == 3
        e.scheduler.check_kv_balance()
    finally:
        if e is not engine:
            e.shutdown()


def test_clamp_flag_caps_max_new_tokens(smol_gguf):
    import loom

    with loom.Engine(max_total_tokens=4096, clamp_max_new_tokens=True, context_length=64) as e:
        ids = [100] * 60
        out = e.generate(
            input_ids=ids, sampling_params={"max_new_tokens": 2**31 - 1, "ignore_eos": True}
        )
        assert out["meta_info"]["completion_tokens"] == 4
        assert out["meta_info"]["finish_reason"]["type"] == "length"
        e.scheduler.check_kv_balance()


def test_check_number_formula():
    assert check_number("top_p", 1) == 1
    assert check_number("top_k", -1) == -1
    for name, bad in [("top_p", 0), ("temperature", -1e-9), ("n", 65), ("top_k", -2)]:
        with pytest.raises(ParamError):
            check_number(name, bad)
    with pytest.raises(ParamError, match="an integer of 4001 bits"):
        check_number("max_new_tokens", 2**4000)
    check_context(10, 90, 100)
    with pytest.raises(ParamError, match="101 were requested"):
        check_context(10, 91, 100)


# ---- failures inside the scheduler ---------------------------------------------------------


class _Boom(LogitsProcessor):
    """Fails on the requests whose params say so; otherwise leaves the logits alone."""

    def __call__(self, logits, params_per_row, token_ids_per_row):
        if any(p.get("boom") for p in params_per_row):
            raise RuntimeError("boom")
        return logits


@pytest.fixture(scope="module")
def boom():
    plugins.ensure_loaded()
    plugins.register("logits_processor", "loom-test-boom", _Boom, override=True)
    return "loom-test-boom"


def _solo(engine, prompts):
    return [engine.generate(p, GREEDY)["output_ids"] for p in prompts]


def _is_error(out, status):
    meta = out["meta_info"]
    return meta.get("error") and meta["finish_reason"]["status_code"] == status


def test_a_failing_logits_processor_fails_only_its_request(engine, boom):
    expected = _solo(engine, PROMPTS)
    params = [
        {**GREEDY, "custom_logit_processor": boom},
        {**GREEDY, "custom_logit_processor": boom, "custom_params": {"boom": True}},
        GREEDY,
    ]
    outs = engine.generate(PROMPTS, params)
    assert _is_error(outs[1], 500) and "boom" in outs[1]["meta_info"]["error"]
    assert [outs[0]["output_ids"], outs[2]["output_ids"]] == [expected[0], expected[2]]
    engine.scheduler.check_kv_balance()


def test_a_failing_grammar_matcher_fails_only_its_request(engine, monkeypatch):
    expected = _solo(engine, PROMPTS[:2])
    from loom.constrained import xgrammar_backend

    def broken(self, token):
        raise RuntimeError("matcher broke")

    monkeypatch.setattr(xgrammar_backend.XGrammarMatcher, "accept_token", broken)
    params = [GREEDY, {**GREEDY, "regex": "[a-z ]+"}, GREEDY]
    outs = engine.generate([PROMPTS[0], PROMPTS[2], PROMPTS[1]], params)
    assert _is_error(outs[1], 500) and "matcher broke" in outs[1]["meta_info"]["error"]
    assert [outs[0]["output_ids"], outs[2]["output_ids"]] == expected
    engine.scheduler.check_kv_balance()


def test_a_failing_admission_fails_only_its_request(engine, monkeypatch):
    expected = _solo(engine, PROMPTS[:2])
    sched = engine.scheduler
    real = sched.prefill._pages_to_admit

    def pages(req, matched):
        if req.rid == "bad-admission":
            raise OverflowError("Python int too large to convert to C long")
        return real(req, matched)

    monkeypatch.setattr(sched.prefill, "_pages_to_admit", pages)
    outs = engine.generate(
        [PROMPTS[0], PROMPTS[2], PROMPTS[1]], GREEDY, rid=["a1", "bad-admission", "a2"]
    )
    assert _is_error(outs[1], 500) and "OverflowError" in outs[1]["meta_info"]["error"]
    assert [outs[0]["output_ids"], outs[2]["output_ids"]] == expected
    sched.check_kv_balance()


def test_a_failed_step_fails_its_batch_and_the_engine_goes_on(engine, monkeypatch):
    expected = _solo(engine, PROMPTS)
    runner = engine.runner
    real = runner.forward_decode
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device went away")
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "forward_decode", flaky)
    outs = engine.generate(PROMPTS, GREEDY)
    assert all(_is_error(o, 500) for o in outs), [o["meta_info"] for o in outs]
    assert "device went away" in outs[0]["meta_info"]["error"]
    engine.scheduler.check_kv_balance()
    # the next requests are served as if nothing had happened
    assert [o["output_ids"] for o in engine.generate(PROMPTS, GREEDY)] == expected
    assert engine.scheduler._live == {}
    engine.scheduler.check_kv_balance()


def test_processor_returning_the_wrong_shape_is_an_error(engine):
    class Shrink(LogitsProcessor):
        def __call__(self, logits, params_per_row, token_ids_per_row):
            return logits[:, :10]

    plugins.register("logits_processor", "loom-test-shrink", Shrink, override=True)
    out = engine.generate("Hi", {**GREEDY, "custom_logit_processor": "loom-test-shrink"})
    assert _is_error(out, 500) and "shape" in out["meta_info"]["error"]
    engine.scheduler.check_kv_balance()
    assert engine.generate("Hi", GREEDY)["meta_info"]["completion_tokens"] == 6
