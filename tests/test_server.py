"""A real `loom serve` in a subprocess on a free loopback port, driven by the official openai
client and plain HTTP."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

from tests.conftest import chat_ids, http_get, http_post, http_stream

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    out = subprocess.run(
        ["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True
    ).stdout
    return [int(x) for x in out.split()]


class Server:
    def __init__(self, *flags: str, api_key: str | None = None) -> None:
        if api_key:
            flags = (*flags, "--api-key", api_key)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "loom.cli",
                "serve",
                "--port",
                str(self.port),
                "--max-total-tokens",
                "16384",
                *flags,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        deadline = time.time() + 180
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stdout.read()}")
            try:
                if http_get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            self.stop()
            raise TimeoutError("server did not start")
        try:
            self.children = _children(self.proc.pid)
            info = http_get(self.url + "/server_info", headers=self.headers).json()
            assert "scheduler_pid" in info, info
            self.scheduler_pid = info["scheduler_pid"]
        except BaseException:
            self.stop()
            raise

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead too
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused")


def _kv_balanced(server) -> bool:
    for _ in range(50):
        info = http_get(server.url + "/server_info").json()
        free, cached = info["kv_free_pages"], info["kv_cached_pages"]
        if free + cached == info["kv_total_pages"] and info["num_running_reqs"] == 0:
            return True
        time.sleep(0.1)
    return False


def test_scheduler_runs_in_its_own_process(server):
    assert server.scheduler_pid in server.children


def test_chat_greedy_equals_engine(client, engine):
    want = engine.generate(
        input_ids=chat_ids(engine, MESSAGES[0]["content"]),
        sampling_params={"max_new_tokens": 32, "temperature": 0},
    )
    resp = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=MESSAGES, max_tokens=32, temperature=0
    )
    assert resp.choices[0].message.content == want["text"] == "The capital of France is Paris."
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.prompt_tokens == want["meta_info"]["prompt_tokens"]
    assert resp.usage.completion_tokens == want["meta_info"]["completion_tokens"]
    # (the chat template's system prompt may already be cached from an earlier request)
    assert 0 <= resp.usage.prompt_tokens_details.cached_tokens < resp.usage.prompt_tokens


def test_logprobs_through_the_openai_client(client, engine, hf_model):
    """Chat logprobs (non-streamed and streamed) equal HF's log_softmax on the same ids."""
    msgs = [{"role": "user", "content": "Name a color."}]
    ids = engine.apply_chat_template(msgs)
    kw = dict(model="smollm2-135m-instruct", messages=msgs, max_tokens=5, temperature=0)
    r = client.chat.completions.create(logprobs=True, top_logprobs=3, **kw)
    content = r.choices[0].logprobs.content
    out_ids = engine.tokenizer.encode(r.choices[0].message.content, add_special_tokens=False)
    with torch.no_grad():
        lsm = torch.log_softmax(hf_model(torch.tensor([ids + out_ids])).logits[0].float(), -1)
    assert len(content) == r.usage.completion_tokens
    for j, item in enumerate(content[: len(out_ids)]):
        pos = len(ids) - 1 + j
        assert abs(item.logprob - lsm[pos, out_ids[j]].item()) < 1e-3
        assert [t.logprob for t in item.top_logprobs] == pytest.approx(
            lsm[pos].topk(3).values.tolist(), abs=1e-3
        )
    streamed = []
    for chunk in client.chat.completions.create(logprobs=True, stream=True, **kw):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += [c.logprob for c in chunk.choices[0].logprobs.content]
    # (the second request reuses the cached prompt: same values up to float rounding)
    assert streamed == pytest.approx([c.logprob for c in content], abs=1e-4)
    c = client.completions.create(
        model="smollm2-135m-instruct", prompt="Once upon", max_tokens=4, temperature=0, logprobs=2
    )
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == c.choices[0].text


def test_generate_native_n_and_logprobs(server):
    body = {
        "text": "Once upon a time",
        "sampling_params": {"max_new_tokens": 4, "temperature": 1.0, "n": 3, "seed": 2},
        "return_logprob": True,
    }
    outs = http_post(server.url + "/generate", json=body, timeout=60).json()
    assert isinstance(outs, list) and len(outs) == 3
    assert len({tuple(o["output_ids"]) for o in outs}) >= 2  # seeds 2, 3, 4
    for o in outs:
        lps = o["meta_info"]["output_token_logprobs"]
        assert [t for _, t, _ in lps] == o["output_ids"]
    again = http_post(server.url + "/generate", json=body, timeout=60).json()
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in outs]


def test_completions_echo_and_best_of(client, engine):
    kw = dict(model="smollm2-135m-instruct", prompt="Once upon a time", max_tokens=5, temperature=0)
    plain = client.completions.create(**kw)
    echoed = client.completions.create(echo=True, **kw)
    assert echoed.choices[0].text == "Once upon a time" + plain.choices[0].text
    lp = client.completions.create(echo=True, logprobs=1, **kw).choices[0].logprobs
    n_prompt = len(engine.tokenizer.encode("Once upon a time"))
    assert len(lp.tokens) == n_prompt + 5
    assert lp.token_logprobs[0] is None and all(v is not None for v in lp.token_logprobs[1:])
    # every token but the first has its top entry, as good as the token's own
    assert lp.top_logprobs[0] is None
    for v, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
        assert len(top) == 1 and max(top.values()) >= v - 1e-6
    assert "".join(lp.tokens) == "Once upon a time" + plain.choices[0].text
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(echo=True, stream=True, **kw)
    )
    assert streamed == echoed.choices[0].text
    best = client.completions.create(
        model="smollm2-135m-instruct", prompt="Once upon a time", max_tokens=6,
        temperature=1.0, best_of=3, seed=4, logprobs=0,
    )  # fmt: skip
    assert len(best.choices) == 1 and best.usage.completion_tokens == 18  # 3 samples were drawn
    single = [
        client.completions.create(
            model="smollm2-135m-instruct", prompt="Once upon a time", max_tokens=6,
            temperature=1.0, seed=4 + i, logprobs=0,
        ).choices[0]
        for i in range(3)
    ]  # fmt: skip

    def mean(c):
        return sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs)

    assert best.choices[0].text == max(single, key=mean).text


def test_sampling_extras_through_the_openai_client(client):
    kw = dict(model="smollm2-135m-instruct", messages=MESSAGES, max_tokens=8)
    r = client.chat.completions.create(n=4, temperature=1.0, seed=11, **kw)
    texts = [c.message.content for c in r.choices]
    assert len(texts) == 4 and len(set(texts)) >= 3
    again = client.chat.completions.create(n=4, temperature=1.0, seed=11, **kw)
    assert [c.message.content for c in again.choices] == texts  # seeded: reproducible
    forced = client.chat.completions.create(
        temperature=0, logit_bias={"42": 100}, max_tokens=3, model=kw["model"], messages=MESSAGES
    )
    assert forced.usage.completion_tokens == 3
    r = client.chat.completions.create(
        temperature=0,
        frequency_penalty=1.0,
        presence_penalty=0.5,
        extra_body={"repetition_penalty": 1.2, "top_k": 5, "min_p": 0.1, "min_tokens": 6},
        **kw,
    )
    assert r.usage.completion_tokens >= 6
    # the example plug-in's processor (installed by make setup) forces a token
    r = client.chat.completions.create(
        temperature=0.8,
        extra_body={
            "custom_logit_processor": "example_force_token",
            "custom_params": {"token_id": 42},
        },
        **kw,
    )
    assert r.usage.completion_tokens == 8


def test_structured_output_through_the_openai_client(client):
    import jsonschema

    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "population": {"type": "integer"},
        },
        "required": ["city", "population"],
    }
    r = client.chat.completions.create(
        model="smollm2-135m-instruct",
        messages=[{"role": "user", "content": "Name a big city and its population, as JSON."}],
        max_tokens=64,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
    )
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    assert r.choices[0].finish_reason == "stop"
    r = client.completions.create(
        model="smollm2-135m-instruct",
        prompt="The year the Berlin wall fell:",
        max_tokens=8,
        temperature=0,
        extra_body={"regex": "19[0-9]{2}"},
    )
    assert re.fullmatch("19[0-9]{2}", r.choices[0].text)
    r = client.chat.completions.create(
        model="smollm2-135m-instruct",
        messages=[{"role": "user", "content": 'Reply with {"ok": true} and nothing else.'}],
        max_tokens=64,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_cache_salt_namespaces_the_prefix_cache(client):
    """Same messages: a new salt gets no cached tokens, a repeated salt gets them."""
    msgs = [{"role": "user", "content": "Name three rivers in Europe, briefly."}]

    def cached(**extra):
        r = client.chat.completions.create(
            model="smollm2-135m-instruct", messages=msgs, max_tokens=4, temperature=0,
            extra_body=extra,
        )  # fmt: skip
        return r.usage.prompt_tokens_details.cached_tokens, r.choices[0].message.content

    a = cached(cache_salt="tenant-a", priority=2)
    b = cached(cache_salt="tenant-b")
    a2 = cached(cache_salt="tenant-a")
    assert a[0] == 0 and b[0] == 0 and a2[0] > 0
    assert a[1] == b[1] == a2[1]


def test_chat_stream_equals_non_stream(client):
    kwargs = dict(
        model="smollm2-135m-instruct",
        max_tokens=40,
        temperature=0,
        messages=[
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Write a haiku about the sea."},
        ],
    )
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(
        client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kwargs
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")


def test_n_choices(client):
    resp = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=MESSAGES, n=3, max_tokens=8, temperature=1.0, seed=3
    )
    assert [c.index for c in resp.choices] == [0, 1, 2]
    one = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=MESSAGES, max_tokens=1
    )
    assert resp.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counts once
    assert 3 <= resp.usage.completion_tokens <= 24
    assert len({c.message.content for c in resp.choices}) > 1  # seed + i per choice


def test_completions_list_and_stream(client, engine):
    prompts = ["The capital of France is", "1, 2, 3, 4,"]
    resp = client.completions.create(
        model="smollm2-135m-instruct", prompt=prompts, max_tokens=6, temperature=0
    )
    assert len(resp.choices) == 2
    for prompt, choice in zip(prompts, resp.choices, strict=True):
        want = engine.generate(prompt, {"max_new_tokens": 6, "temperature": 0})["text"]
        assert choice.text == want
    stream = client.completions.create(
        model="smollm2-135m-instruct", prompt=prompts[0], max_tokens=6, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == resp.choices[0].text


def test_models(client):
    assert [m.id for m in client.models.list().data] == ["smollm2-135m-instruct"]


def test_generate_native(server, engine):
    url = server.url + "/generate"
    sp = {"max_new_tokens": 8, "temperature": 0}
    single = http_post(url, json={"text": "Hello, my name is", "sampling_params": sp}).json()
    assert single["text"] == engine.generate("Hello, my name is", sp)["text"]
    assert single["meta_info"]["completion_tokens"] == len(single["output_ids"]) == 8
    batch = http_post(
        url, json={"text": ["Hello, my name is", "Paris is"], "sampling_params": sp}
    ).json()
    assert batch[0]["output_ids"] == single["output_ids"] and len(batch) == 2
    ids = http_post(url, json={"input_ids": single["output_ids"][:3], "sampling_params": sp}).json()
    assert len(ids["output_ids"]) == 8
    with http_stream(
        "POST", url, json={"text": "Hello, my name is", "sampling_params": sp, "stream": True}
    ) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][6:])
    assert last["text"] == single["text"] and last["output_ids"] == single["output_ids"]


def test_health_generate_and_info(server):
    assert http_get(server.url + "/health_generate", timeout=60).status_code == 200
    info = http_get(server.url + "/model_info").json()
    assert info["architecture"] == "LlamaForCausalLM"
    assert http_get(server.url + "/get_model_info").json() == info
    assert http_post(server.url + "/flush_cache").status_code == 200


def test_abort_request(server):
    result = {}

    def run():
        result["r"] = http_post(
            server.url + "/generate",
            timeout=120,
            json={
                "text": "Count forever:",
                "rid": "long-one",
                "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True},
            },
        ).json()

    t = threading.Thread(target=run)
    t.start()
    time.sleep(1.5)
    assert http_post(server.url + "/abort_request", json={"rid": "long-one"}).status_code == 200
    t.join(60)
    assert result["r"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert result["r"]["meta_info"]["completion_tokens"] < 2000
    assert _kv_balanced(server)


def test_concurrent_streams_with_disconnects(server):
    n_tokens, results = 24, {}

    def run(i: int) -> None:
        body = {
            "text": f"Story number {i}:",
            "stream": True,
            "sampling_params": {"max_new_tokens": n_tokens, "ignore_eos": True, "temperature": 0},
        }
        with http_stream("POST", server.url + "/generate", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                results[i] = len(chunk["output_ids"])
                if i < 8 and results[i] >= n_tokens // 2:
                    return  # disconnect half-way

    threads = [threading.Thread(target=run, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert all(results[i] == n_tokens for i in range(8, 32))
    assert all(n_tokens // 2 <= results[i] < n_tokens for i in range(8))
    assert _kv_balanced(server)
    metrics = http_get(server.url + "/metrics").text
    assert "loom:time_to_first_token_seconds_count" in metrics
    assert "loom:num_aborted_requests_total" in metrics


def test_non_streaming_client_disconnect_aborts(server):
    before = http_get(server.url + "/metrics").text.count("\n")
    with pytest.raises(httpx.ReadTimeout):
        http_post(
            server.url + "/generate",
            timeout=1.5,
            json={
                "text": "Count forever:",
                "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True},
            },
        )
    assert before > 0
    assert _kv_balanced(server)  # aborted long before 3000 tokens


BAD = [
    ("/v1/chat/completions", b"{not json", 400, None),
    ("/v1/chat/completions", {"messages": MESSAGES, "bogus": 1}, 400, "bogus"),
    ("/v1/chat/completions", {"messages": MESSAGES, "temperature": -1}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_p": 2}, 400, "top_p"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    (
        "/v1/chat/completions",
        {"messages": MESSAGES, "frequency_penalty": 2.5},
        400,
        "frequency_penalty",
    ),
    (
        "/v1/chat/completions",
        {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21},
        400,
        "top_logprobs",
    ),
    (
        "/v1/chat/completions",
        {"messages": MESSAGES, "presence_penalty": -3},
        400,
        "presence_penalty",
    ),
    (
        "/v1/chat/completions",
        {"messages": MESSAGES, "repetition_penalty": 0},
        400,
        "repetition_penalty",
    ),
    ("/v1/chat/completions", {"messages": MESSAGES, "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("/v1/chat/completions", {"messages": MESSAGES, "min_tokens": -1}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 9}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "n": 3, "best_of": 2}, 400, "best_of"),
    ("/v1/completions", {"prompt": "hi", "best_of": 2, "stream": True}, 400, "best_of"),
    ("/v1/completions", {"prompt": "hi", "echo": "yes"}, 400, "echo"),
    (
        "/v1/chat/completions",
        {"messages": MESSAGES, "custom_logit_processor": '{"callable": "80049500"}'},
        400,
        "custom_logit_processor",
    ),
    (
        "/v1/chat/completions",
        {
            "messages": MESSAGES,
            "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}},
        },
        400,
        "json_schema",
    ),
    ("/v1/chat/completions", {"messages": MESSAGES, "regex": "(unclosed"}, 400, "regex"),
    (
        "/v1/completions",
        {"prompt": "hi", "regex": "a", "ebnf": 'root ::= "a"'},
        400,
        "ebnf",
    ),
    ("/generate", {"text": "hi", "sampling_params": {"json_schema": "{bad"}}, 400, "json_schema"),
    ("/v1/chat/completions", {"messages": MESSAGES, "model": "gpt-4"}, 404, "model"),
    (
        "/v1/chat/completions",
        {"messages": MESSAGES, "model": "smollm2-135m-instruct:sql"},
        404,  # an adapter this server does not serve is a model it does not have (OpenAI, vLLM)
        "model",
    ),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi" * 10000}, 400, "prompt"),
    ("/generate", {"text": "hi", "sampling_params": {"temperature": -2}}, 400, "temperature"),
    ("/generate", {"text": "hi", "sampling_params": {"nope": 1}}, 400, "nope"),
    ("/abort_request", {}, 400, "rid"),
    ("/v1/chat/completions", {"messages": MESSAGES, "cache_salt": 5}, 400, "cache_salt"),
    ("/v1/chat/completions", {"messages": MESSAGES, "priority": "high"}, 400, "priority"),
    ("/generate", {"text": "hi", "extra_key": 3}, 400, "extra_key"),
    # LoRA is off on this server
    ("/generate", {"text": "hi", "lora_path": "sql"}, 400, None),
    ("/v1/chat/completions", {"messages": MESSAGES, "lora_path": 3}, 400, "lora_path"),
    ("/load_lora_adapter", {"lora_name": "sql", "lora_path": "/x"}, 400, None),
]


@pytest.mark.parametrize("path,body,status,param", BAD)
def test_bad_input(server, client, path, body, status, param):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = http_post(server.url + path, headers={"content-type": "application/json"}, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    if isinstance(body, dict) and "hi" * 100 in json.dumps(body):
        assert "context length" in err["message"] and "8192" in err["message"]
    # ... and the server keeps answering
    resp = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=MESSAGES, max_tokens=2, temperature=0
    )
    assert resp.choices[0].message.content


@pytest.mark.parametrize("fronts", [1, 2])
def test_api_key_queue_limit_and_sigterm(fronts):
    """With two front-end processes (``--tokenizer-worker-num 2``) each checks the key, and
    each admits its share of the queue limit."""
    s = Server(
        "--max-running-requests",
        "1",
        "--max-queued-requests",
        "2",
        "--tokenizer-worker-num",
        str(fronts),
        api_key="sekret",
    )
    try:
        url = s.url + "/v1/models"
        key = {"Authorization": "Bearer sekret"}
        checked = set()
        for _ in range(200):  # a connection to each front end, found by asking it
            with httpx.Client(timeout=30) as c:
                front_end = c.get(s.url + "/server_info", headers=key).json()["front_end"]
                if front_end in checked:
                    continue
                checked.add(front_end)
                assert c.get(url).status_code == 401
                assert c.get(url, headers={"Authorization": "Bearer wrong"}).status_code == 401
                assert c.get(url, headers=key).status_code == 200
                assert c.get(s.url + "/health").status_code == 200  # no key needed
            if len(checked) == fronts:
                break
        assert checked == set(range(fronts))
        statuses = []

        def run():
            r = http_post(
                s.url + "/generate",
                timeout=120,
                headers={"Authorization": "Bearer sekret"},
                json={"text": "Hi", "sampling_params": {"max_new_tokens": 64, "ignore_eos": True}},
            )
            statuses.append((r.status_code, r.headers.get("retry-after")))

        threads = [threading.Thread(target=run) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        codes = [c for c, _ in statuses]
        assert 200 in codes and 503 in codes
        assert all(ra == "1" for c, ra in statuses if c == 503)
    finally:
        children = s.children
        rc = s.stop()
    assert rc in (0, -signal.SIGTERM)  # uvicorn re-raises the signal after a clean shutdown
    time.sleep(0.5)
    assert children and not any(_alive(p) for p in children)


def test_scheduler_crash_stops_the_server():
    s = Server()
    try:
        os.kill(s.scheduler_pid, signal.SIGKILL)
        rc = s.proc.wait(timeout=60)
        out = s.proc.stdout.read()
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
    assert rc != 0 and "scheduler process died" in out


def test_server_killed_takes_the_scheduler_with_it():
    s = Server()
    child = s.scheduler_pid
    s.proc.kill()  # SIGKILL: no chance to clean up; the kernel's parent-death signal does it
    s.proc.wait(timeout=30)
    for _ in range(50):
        if not _alive(child):
            break
        time.sleep(0.1)
    assert not _alive(child)


def test_openapi_lists_the_request_bodies(server):
    """The generation routes' bodies are pydantic models (``server/schemas.py``): FastAPI's
    OpenAPI schema lists their fields, and a field they do not declare is a 400 naming it."""
    paths = http_get(server.url + "/openapi.json").json()["paths"]
    for path, field in [
        ("/v1/chat/completions", "messages"),
        ("/v1/completions", "best_of"),
        ("/generate", "sampling_params"),
    ]:
        schema = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert field in schema["properties"] and schema["additionalProperties"] is False
    r = http_post(
        server.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "echo": True},
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "echo"
    assert "unknown field 'echo'" in r.json()["error"]["message"]
