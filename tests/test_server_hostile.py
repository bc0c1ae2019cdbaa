"""A live `loom serve` under hostile input: the cases that took the server down as plain
regression tests, a fuzz test (hypothesis) of bodies built from the OpenAI and native schemas
with hostile values sent concurrently with good requests, and the exit deadlines (after the
scheduler dies, and after SIGTERM under load)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import http_request
from tests.test_server import MESSAGES, Server, _alive, _kv_balanced

MODEL = "smollm2-135m-instruct"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GENERATE = "/generate"


@pytest.fixture(scope="module")
def server():
    s = Server("--max-request-body-mb", "1")
    yield s
    s.stop()


def _is_openai_error(r: httpx.Response) -> bool:
    try:
        err = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return set(err) == {"message", "type", "param", "code"} and bool(err["message"])


def _post(server, path, body: bytes, timeout=60.0, **headers) -> httpx.Response:
    return httpx.post(
        server.url + path,
        content=body,
        headers={"content-type": "application/json", **headers},
        timeout=timeout,
    )


def _good(server) -> str:
    r = httpx.post(
        server.url + CHAT,
        json={"model": MODEL, "messages": MESSAGES, "max_tokens": 8, "temperature": 0},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


# ---- the cases, as regression tests --------------------------------------------------

CASES = [
    # (path, raw body, status, param, a phrase of the message)
    (
        COMPLETIONS,
        b'{"prompt": "Hi", "max_tokens": 9223372036854775808}',
        400,
        "max_tokens",
        "2**63 - 1",
    ),
    (COMPLETIONS, b'{"prompt": "Hi", "max_tokens": 1000000000000}', 400, "max_tokens", "8192"),
    (
        CHAT,
        b'{"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 9000}',
        400,
        "max_completion_tokens",
        "new tokens fit",
    ),
    (
        CHAT,
        b'{"messages": [{"role": "user", "content": "Hi"}], "temperature": NaN}',
        400,
        "temperature",
        "NaN",
    ),
    (
        GENERATE,
        b'{"text": "Hi", "sampling_params": {"temperature": NaN}}',
        400,
        "sampling_params",
        "NaN",
    ),
    (
        GENERATE,
        b'{"text": "Hi", "sampling_params": {"top_p": -Infinity}}',
        400,
        "sampling_params",
        "Infinity",
    ),
    (CHAT, b"[" * 10_000 + b"]" * 10_000, 400, None, "nested deeper"),
    (
        GENERATE,
        b'{"text": ' + b'{"a": ' * 100 + b"1" + b"}" * 100 + b"}",
        400,
        "text",
        "nested deeper",
    ),
    (
        CHAT,
        b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}',
        400,
        "messages",
        "messages[0].content is not valid Unicode",
    ),
    (GENERATE, b'{"text": "\\udfff"}', 400, "text", "not valid Unicode"),
    (CHAT, b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, None, "UTF-8"),
    (COMPLETIONS, b'{"prompt": "Hi", "max_tokens": ' + b"9" * 5000 + b"}", 400, None, "malformed"),
    (COMPLETIONS, b'{"prompt": "Hi", "seed": 18446744073709551616}', 400, "seed", "seed must be"),
    (COMPLETIONS, b'{"prompt": "Hi", "n": 1e400}', 400, "n", "Infinity"),
    (GENERATE, b'{"input_ids": 5}', 400, "input_ids", "list"),
    (GENERATE, b'{"text": []}', 400, "text", "empty"),
    (GENERATE, b'{"text": "Hi", "rid": 5}', 400, "rid", "string"),
    (
        CHAT,
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}',
        400,
        "messages",
        "string",
    ),
]


@pytest.mark.parametrize("path,body,status,param,phrase", CASES)
def test_hostile_body(server, path, body, status, param, phrase):
    r = _post(server, path, body)
    assert r.status_code == status, r.text
    assert _is_openai_error(r), r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert phrase in err["message"], err


def test_huge_max_tokens_while_another_request_runs(server):
    """The original crash: sent next to a running request, it reached admission's int64."""
    expected = _good(server)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        good = pool.submit(_good, server)
        time.sleep(0.05)
        r = _post(server, COMPLETIONS, b'{"prompt": "Hi", "max_tokens": 9223372036854775808}')
        assert r.status_code == 400 and _is_openai_error(r)
        assert good.result() == expected
    assert _good(server) == expected and _kv_balanced(server)


def test_errors_in_openai_shape_everywhere(server):
    for method, path, status in [
        ("GET", "/no/such/route", 404),
        ("GET", CHAT, 405),
        ("DELETE", "/health", 405),
    ]:
        r = http_request(method, server.url + path)
        assert r.status_code == status and _is_openai_error(r), r.text
    big = b'{"prompt": "' + b"a" * (2 << 20) + b'"}'
    r = _post(server, COMPLETIONS, big)
    assert r.status_code == 413 and _is_openai_error(r), r.text


# ---- the fuzz test ---------------------------------------------------------------------------

# Hostile values: huge, negative, NaN / Infinity, wrong types, odd Unicode, nesting, lists.
SPECIAL_INTS = [2**31, 2**63, 2**64, -(2**63) - 1, 10**30, -1, 0, 10**6]
ODD_TEXT = ["\ud800", "a\udfffb", "\x00", "\u202e\u200b", "🦙" * 8, "", " " * 64, "<|im_end|>"]
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from(SPECIAL_INTS),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e308, -0.0, 5e-324]),
    st.sampled_from(ODD_TEXT),
    st.text(max_size=12),
)
hostile = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
) | st.sampled_from(
    [
        list(range(20_000)),  # a huge list
        {str(i): 1.0 for i in range(5_000)},
        [[[[[[[[[[[]]]]]]]]]]],
    ]
)
# max_tokens takes only values that cannot start a long generation: small, or refused
small_or_refused = st.one_of(
    st.integers(1, 4),
    st.sampled_from([0, -1, 2**63, 10**12, 9000, 1.5, "4", None, True, float("nan")]),
)
# Fields whose hostile values should also reach deeper code: valid names and shapes with
# hostile contents.
PROCESSORS = ["disallowed_tokens", "thinking_budget", "no_repeat_ngram"]
TAILORED = {
    "custom_logit_processor": st.sampled_from(PROCESSORS) | hostile,
    "custom_params": st.fixed_dictionaries(
        {},
        optional={"token_ids": hostile, "budget": hostile, "think_end_ids": hostile, "n": hostile},
    )
    | hostile,
    "response_format": st.fixed_dictionaries(
        {"type": st.sampled_from(["json_schema", "json_object", "text", "structural_tag", "x"])},
        optional={
            "json_schema": st.fixed_dictionaries({"name": st.just("x"), "schema": hostile})
            | hostile
        },
    )
    | hostile,
    "regex": st.sampled_from(["[a-z]+", "(unclosed", "\\d{2,3}", "", "\ud800"]) | hostile,
    "json_schema": st.sampled_from(['{"type": "integer"}', "{bad", "[]"]) | hostile,
}
SAMPLING = [
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "n",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_tokens",
    "logit_bias",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "logprobs",
    "top_logprobs",
    "priority",
    "cache_salt",
    "response_format",
    "regex",
    "stream",
    "stream_options",
    "user",
    "model",
    "lora_path",
    "custom_logit_processor",
    "custom_params",
    "tools",
    "a_field_nobody_knows",
]
NATIVE = [
    "return_logprob",
    "top_logprobs_num",
    "logprob_start_len",
    "rid",
    "priority",
    "extra_key",
    "lora_path",
    "stream",
    "sampling_params",
    "bogus",
]
NATIVE_SAMPLING = [
    "custom_logit_processor",
    "custom_params",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "stop",
    "stop_token_ids",
    "json_schema",
    "regex",
    "logit_bias",
    "min_new_tokens",
    "ignore_eos",
    "sampling_seed",
    "repetition_penalty",
    "custom_params",
    "no_stop_trim",
]


@st.composite
def request_bodies(draw) -> tuple[str, bytes]:
    path = draw(st.sampled_from([CHAT, COMPLETIONS, GENERATE]))
    if path == GENERATE:
        body = {"text": "Hello", "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
        for key in draw(st.lists(st.sampled_from(NATIVE), max_size=2, unique=True)):
            body[key] = draw(hostile)
        if isinstance(body.get("sampling_params"), dict):
            sp = body["sampling_params"]
            for key in draw(st.lists(st.sampled_from(NATIVE_SAMPLING), max_size=3, unique=True)):
                sp[key] = draw(TAILORED.get(key, hostile))
            sp["max_new_tokens"] = draw(small_or_refused)
        if draw(st.booleans()):
            body["text"] = draw(hostile)
    else:
        body = {"model": MODEL, "max_tokens": draw(small_or_refused), "temperature": 0}
        if path == CHAT:
            body["messages"] = [{"role": "user", "content": "Hello"}]
            if draw(st.booleans()):
                msg = {"role": draw(st.sampled_from(["user", "system", "tool", "x"]))}
                msg["content"] = draw(hostile)
                body["messages"] = draw(st.sampled_from([[msg], [*body["messages"], msg], msg]))
        else:
            body["prompt"] = draw(st.one_of(st.just("Hello"), hostile))
            for key in draw(st.lists(st.sampled_from(["echo", "best_of", "suffix"]), max_size=1)):
                body[key] = draw(hostile)
        for key in draw(st.lists(st.sampled_from(SAMPLING), max_size=3, unique=True)):
            body[key] = draw(TAILORED.get(key, hostile))
        if draw(st.booleans()):
            body["max_completion_tokens"] = draw(small_or_refused)
    raw = json.dumps(body, allow_nan=True).encode()
    # and a few byte-level mutations: cut short, or a byte that is not UTF-8
    cut = draw(st.sampled_from([None] * 8 + ["truncate", "badbyte"]))
    if cut == "truncate":
        raw = raw[: draw(st.integers(0, max(len(raw) - 1, 0)))]
    elif cut == "badbyte":
        at = draw(st.integers(0, len(raw)))
        raw = raw[:at] + b"\xc3\x28" + raw[at:]
    return path, raw


def _shape(path: str, raw: bytes) -> tuple:
    try:
        body = json.loads(raw)
    except ValueError:
        return (path, "not json")
    if not isinstance(body, dict):
        return (path, type(body).__name__)
    return (path, tuple(sorted((k, type(v).__name__) for k, v in body.items())))


def _check_answer(r: httpx.Response) -> None:
    assert 200 <= r.status_code < 300 or 400 <= r.status_code < 500, (r.status_code, r.text)
    if r.status_code >= 400:
        assert _is_openai_error(r), r.text
        return
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", r.text[-500:]
        for e in events[:-1]:
            assert "error" not in json.loads(e), e  # a valid request streams without errors
    else:
        r.json()


FUZZ = {"requests": 0, "shapes": set(), "statuses": {}}


# 240 hostile bodies in rounds of 6 concurrent ones. (Rounds of 12 ran in 26 s alone, but in
# `make test` beside another worker on 2 cores a request of a round went unanswered for 120 s,
# twice; not yet explained.)
@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,  # the same bodies on every run: CI stays deterministic
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(batch=st.lists(request_bodies(), min_size=6, max_size=6))
def _fuzz_round(server, batch):
    with concurrent.futures.ThreadPoolExecutor(len(batch)) as pool:
        answers = list(pool.map(lambda pr: _post(server, pr[0], pr[1], timeout=120), batch))
    for (path, raw), r in zip(batch, answers, strict=True):
        FUZZ["requests"] += 1
        FUZZ["shapes"].add(_shape(path, raw))
        FUZZ["statuses"][r.status_code] = FUZZ["statuses"].get(r.status_code, 0) + 1
        _check_answer(r)


@pytest.fixture(scope="module")
def fuzz_server():
    # `max_tokens: null` is valid (what the context leaves): a prompt that never reaches EOS
    # then generates to the context's end, which a short context keeps within the round's time
    s = Server("--max-request-body-mb", "1", "--context-length", "320")
    yield s
    s.stop()


def test_fuzz_hostile_bodies_next_to_good_requests(fuzz_server):
    server = fuzz_server
    expected = _good(server)
    good: list[str] = []
    stop = threading.Event()

    def good_traffic():
        while not stop.is_set():
            good.append(_good(server))

    t = threading.Thread(target=good_traffic)
    t.start()
    try:
        _fuzz_round(server)
    finally:
        stop.set()
        t.join(120)
    print(
        f"\nfuzz: {FUZZ['requests']} requests, {len(FUZZ['shapes'])} distinct shapes, "
        f"statuses {dict(sorted(FUZZ['statuses'].items()))}; {len(good)} good requests"
    )
    assert good and all(g == expected for g in good)
    assert _good(server) == expected
    assert _kv_balanced(server)
    assert server.proc.poll() is None


# ---- exit deadlines ------------------------------------------------------------------------


def _stream_events(url: str, body: dict, out: list, client: httpx.Client | None = None) -> None:
    try:
        with (client or httpx).stream("POST", url, json=body, timeout=60) as r:
            out.append(r.status_code)
            for line in r.iter_lines():
                if line.startswith("data: "):
                    out.append(line[6:])
    except httpx.HTTPError as e:
        out.append(f"transport error: {e}")


LONG = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4000, "ignore_eos": True}


def test_scheduler_death_ends_requests_with_errors_and_exits_in_time():
    s = Server()
    try:
        streamed: list = []
        t = threading.Thread(
            target=_stream_events, args=(s.url + CHAT, {**LONG, "stream": True}, streamed)
        )
        t.start()
        plain: list = []
        p = threading.Thread(
            target=lambda: plain.append(httpx.post(s.url + CHAT, json=LONG, timeout=60))
        )
        p.start()
        while len(streamed) < 3:  # the stream has started
            time.sleep(0.05)
        time.sleep(0.3)
        t0 = time.monotonic()
        os.kill(s.scheduler_pid, signal.SIGKILL)
        time.sleep(0.5)  # (the front notices within 0.2 s)
        try:
            health = httpx.get(s.url + "/health", timeout=2).status_code
        except httpx.HTTPError:
            health = "refused"
        rc = s.proc.wait(timeout=15)
        exit_s = time.monotonic() - t0
        t.join(10)
        p.join(10)
        out = s.proc.stdout.read()
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
    print(f"\nexit {exit_s:.2f} s after the scheduler was killed")
    assert rc != 0 and "scheduler process died" in out
    assert exit_s < 10
    assert health != 200
    # no request is reported as a normal completion
    assert plain and plain[0].status_code == 503 and _is_openai_error(plain[0]), plain
    events = [json.loads(e) for e in streamed[1:] if e != "[DONE]" and e.startswith("{")]
    assert any("error" in e for e in events), streamed[-3:]
    assert any(c.get("finish_reason") == "error" for e in events for c in e.get("choices", [])), (
        streamed[-3:]
    )


def wait_exit(s, t0: float, threads: list[threading.Thread]) -> tuple[int, float, str]:
    """The server's exit status, the seconds from ``t0`` to its exit and its output, once the
    client threads have ended."""
    rc = s.proc.wait(timeout=15)
    exit_s = time.monotonic() - t0
    for t in threads:
        t.join(10)
    return rc, exit_s, s.proc.stdout.read()


def _openai_stream(url: str, out: list) -> None:
    from openai import APIError, OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    try:
        for chunk in client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=4000,
            stream=True,
            extra_body={"ignore_eos": True},
        ):
            out.append(chunk)
    except APIError as e:
        out.append(e)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, "SIGTERM, scheduler stopped"])
def test_shutdown_under_load_exits_in_time_with_honest_errors(sig):
    s = Server("--log-level", "info")
    try:
        # a client that promises more body than it sends, then goes away
        with socket.create_connection(("127.0.0.1", s.port)) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Content-Length: 1000\r\n\r\n{"prompt": '
            )
            time.sleep(0.2)
        streams = [[] for _ in range(3)]
        threads = [
            threading.Thread(
                target=_stream_events, args=(s.url + CHAT, {**LONG, "stream": True}, out)
            )
            for out in streams
        ]
        via_openai: list = []
        threads.append(threading.Thread(target=_openai_stream, args=(s.url, via_openai)))
        for t in threads:
            t.start()
        while not all(len(out) >= 3 for out in [*streams, via_openai]):
            time.sleep(0.05)
        children = s.children
        if not isinstance(sig, int):  # a scheduler that answers nothing any more
            os.kill(s.scheduler_pid, signal.SIGSTOP)
        t0 = time.monotonic()
        s.proc.send_signal(sig if isinstance(sig, int) else signal.SIGTERM)
        rc, exit_s, out = wait_exit(s, t0, threads)
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
    print(f"\nexit {exit_s:.2f} s after {sig} with 4 streams running")
    assert exit_s < 10, (rc, out[-2000:])
    assert rc in (0, 130, -signal.SIGTERM), (rc, out[-2000:])  # 130: Ctrl-C's exit status
    time.sleep(0.5)
    assert children and not any(_alive(p) for p in children)
    # each stream ended with the shutdown's error, not a cut connection
    for events in streams:
        assert events[-1] == "[DONE]", events[-3:]
        assert any("shutting down" in e for e in events if isinstance(e, str)), events[-3:]
    from openai import APIError

    assert isinstance(via_openai[-1], APIError) and "shutting down" in str(via_openai[-1])
    assert "Traceback" not in out, out[-3000:]
    assert out.count("client disconnected while sending the body") == 1, out[-3000:]
