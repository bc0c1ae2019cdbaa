"""Several front-end processes on one scheduler (`loom serve --tokenizer-worker-num 2`): the
scheduler's routing of outputs by owner (real ZMQ sockets), the queue limit's shares, and a
live server: answers equal the offline engine's from whichever process takes a connection,
metrics add up over the processes, a disconnect frees its KV, and SIGTERM, the scheduler's
death and a front end's death each end every process in time with honest errors."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import threading
import time

import httpx
import pytest

from loom.config import ServerArgs
from loom.engine.front_ends import OwnerRouting
from loom.sampling.sampling_params import SamplingParams
from loom.scheduler.messages import (
    AddRequests,
    GenerateRequest,
    ReqOutput,
    SchedulerBatchOut,
    UpdateWeights,
)
from loom.server.context import queue_share
from tests.test_lora import lora_setup, peft_ref  # noqa: F401 - fixtures
from tests.test_server import Server, _alive, _kv_balanced
from tests.test_server_hostile import LONG, _stream_events, wait_exit

MODEL = "smollm2-135m-instruct"
CHAT = "/v1/chat/completions"


# ---- the scheduler's side: routing by owner ----------------------------------------------------


@pytest.fixture
def routing():
    import zmq

    ctx = zmq.Context()
    fronts, pulls, pushes = [], [], []
    for i in range(2):
        f_push, s_pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        f_push.bind(f"inproc://in{i}")
        s_pull.connect(f"inproc://in{i}")
        s_push, f_pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        f_pull.bind(f"inproc://out{i}")
        s_push.connect(f"inproc://out{i}")
        fronts.append((f_push, f_pull))
        pulls.append(s_pull)
        pushes.append(s_push)
    yield OwnerRouting(pulls, pushes, heartbeat_s=0.2), fronts
    for sock in [*pulls, *pushes, *(s for pair in fronts for s in pair)]:
        sock.close(linger=0)
    ctx.term()


def _req(rid: str) -> GenerateRequest:
    return GenerateRequest(rid, [1, 2, 3], SamplingParams(max_new_tokens=4))


def _received(pull, wait_ms: int = 500) -> list[SchedulerBatchOut]:
    got = []
    while pull.poll(wait_ms):
        got.append(pull.recv_pyobj())
        wait_ms = 50
    return got


def _poll_all(routing, count: int) -> list:
    msgs: list = []
    for _ in range(100):
        msgs += routing.poll(0.05)
        if len(msgs) >= count:
            break
    return msgs


def test_outputs_go_to_the_front_end_that_sent_the_request(routing):
    router, fronts = routing
    fronts[0][0].send_pyobj(AddRequests([_req("a"), _req("b")]))
    fronts[1][0].send_pyobj(AddRequests([_req("c")]))
    fronts[1][0].send_pyobj(UpdateWeights("ctl-1", "/nowhere"))
    msgs = _poll_all(router, 3)
    assert sorted(r.rid for m in msgs if isinstance(m, AddRequests) for r in m.requests) == [
        "a",
        "b",
        "c",
    ]
    done = {"type": "length", "length": 1}
    router.emit(
        SchedulerBatchOut(
            [
                ReqOutput("a", [5], 3, 1),
                ReqOutput("c", [6], 3, 1, finished_reason=done),
                ReqOutput("ctl-1", [], 0, 0, finished_reason={"type": "stop"}),
                ReqOutput("b", [7], 3, 1, finished_reason=done),
            ],
            {"num_running_reqs": 1},
        )
    )
    (to0,) = _received(fronts[0][1])
    (to1,) = _received(fronts[1][1])
    assert [o.rid for o in to0.outputs] == ["a", "b"]
    assert [o.rid for o in to1.outputs] == ["c", "ctl-1"]
    assert to0.stats == to1.stats == {"num_running_reqs": 1}
    # finished requests and answered control messages are forgotten; "a" is still owned
    assert router.owner == {"a": 0}


def test_every_front_end_hears_the_load_figures(routing):
    router, fronts = routing
    fronts[0][0].send_pyobj(AddRequests([_req("a")]))
    _poll_all(router, 1)
    router.emit(SchedulerBatchOut([], {"n": 1}))  # an idle scheduler's figures: to everyone
    assert [b.stats for b in _received(fronts[0][1])] == [{"n": 1}]
    assert [b.stats for b in _received(fronts[1][1])] == [{"n": 1}]
    # a busy step reaches the front end without outputs in it only once a heartbeat is due
    router.emit(SchedulerBatchOut([ReqOutput("a", [1], 3, 1)], {"n": 2}))
    assert _received(fronts[1][1], 100) == []
    time.sleep(0.25)
    router.emit(SchedulerBatchOut([ReqOutput("a", [1], 3, 2)], {"n": 3}))
    (beat,) = _received(fronts[1][1])
    assert beat.outputs == [] and beat.stats == {"n": 3}
    assert len(_received(fronts[0][1])) == 2


def test_a_request_id_in_flight_on_another_front_end_is_refused_to_the_sender(routing):
    router, fronts = routing
    fronts[0][0].send_pyobj(AddRequests([_req("same")]))
    assert len(_poll_all(router, 1)) == 1
    fronts[1][0].send_pyobj(AddRequests([_req("same"), _req("other")]))
    (msg,) = _poll_all(router, 1)
    assert [r.rid for r in msg.requests] == ["other"]
    (refusal,) = _received(fronts[1][1])
    (out,) = refusal.outputs
    assert out.rid == "same" and "duplicate request id" in out.error
    assert out.finished_reason["status_code"] == 400
    assert router.owner == {"same": 0, "other": 1}


def test_the_queue_limit_is_shared_out_exactly():
    for limit in (2, 3, 7, 64):
        for n in (1, 2, 3):
            if limit >= n:
                shares = [queue_share(limit, i, n) for i in range(n)]
                assert sum(shares) == limit and max(shares) - min(shares) <= 1
    assert queue_share(None, 0, 2) is None
    with pytest.raises(ValueError, match="max_queued_requests .* tokenizer_worker_num"):
        ServerArgs(max_queued_requests=1, tokenizer_worker_num=2)
    with pytest.raises(ValueError, match="tokenizer_worker_num must be >= 1"):
        ServerArgs(tokenizer_worker_num=0)


# ---- a live server with two front ends --------------------------------------------------------


@pytest.fixture(scope="module")
def server2():
    s = Server("--tokenizer-worker-num", "2")
    yield s
    s.stop()


def _front_end_of_a_new_connection(url: str) -> int:
    return httpx.get(url + "/server_info", timeout=30).json()["front_end"]


def test_both_front_ends_take_connections_and_answer_as_the_engine(server2, engine):
    seen = set()
    for _ in range(200):
        seen.add(_front_end_of_a_new_connection(server2.url))
        if seen == {0, 1}:
            break
    assert seen == {0, 1}
    prompt = "The three primary colours are"
    want = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 12})["text"]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0}

    def one(_):
        return httpx.post(server2.url + "/v1/completions", json=body, timeout=60).json()

    # one request at a time, each on a new connection (either process may take it)
    answers = [one(i)["choices"][0]["text"] for i in range(6)]
    assert answers == [want] * 6
    # and many at once: each answer whole, usage counted
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(16)))
    assert all(r["usage"]["completion_tokens"] == 12 for r in results), results[:2]
    served = {}
    for _ in range(200):
        info = httpx.get(server2.url + "/server_info", timeout=30).json()
        served[info["front_end"]] = info["profile"]["outputs"]
        if len(served) == 2:
            break
    assert all(n > 0 for n in served.values()) and len(served) == 2, served


def test_metrics_add_up_over_the_front_ends(server2):
    def total() -> float:
        text = httpx.get(server2.url + "/metrics", timeout=30).text
        (line,) = [x for x in text.splitlines() if x.startswith("loom:num_requests_total")]
        return float(line.split()[-1])

    before = total()
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        codes = list(
            pool.map(
                lambda _: (
                    httpx.post(server2.url + "/v1/completions", json=body, timeout=60).status_code
                ),
                range(12),
            )
        )
    assert codes == [200] * 12
    # every process's /metrics reads the same files
    assert {total() - before for _ in range(6)} == {12.0}


def test_bench_serving_reports_every_front_end(server2, tmp_path):
    from tests.test_serving_front import _bench

    (r,) = _bench(server2, tmp_path)
    assert r["completed"] == 6 and r["errors"] == 0
    assert sorted(r["front_ends"]) == ["0", "1"]
    assert all(p["front_cpu"] > 0 for p in r["front_ends"].values())
    assert sum(p["sse_events"] for p in r["front_ends"].values()) >= 6


def test_a_disconnect_frees_its_kv_on_either_front_end(server2):
    for _ in range(4):
        with httpx.stream(
            "POST", server2.url + CHAT, json={**LONG, "stream": True}, timeout=60
        ) as r:
            lines = r.iter_lines()
            while not next(lines).startswith("data: {"):
                pass
        # (closed mid-stream)
    assert _kv_balanced(server2)


def _on_each_front_end(url: str, fronts: int, call) -> None:
    """``call(client, front_end)`` once on a connection to each front end."""
    seen = set()
    for _ in range(400):
        with httpx.Client(timeout=120) as c:
            front_end = c.get(url + "/server_info").json()["front_end"]
            if front_end not in seen:
                seen.add(front_end)
                call(c, front_end)
        if len(seen) == fronts:
            return
    raise AssertionError(f"reached front ends {seen} of {fronts}")


def test_an_adapter_loaded_on_one_front_end_serves_on_every_one(lora_setup, peft_ref):  # noqa: F811
    """``--enable-lora`` with two front ends: an adapter loaded through one is served by both
    (peft's tokens); loading a name twice is refused whichever front end asks; an unload is
    refused while the other front end's request runs on the adapter, and once it has ended the
    unload leaves the name unknown to both."""
    from tests.test_lora import GREEDY, PROMPTS

    base, paths = lora_setup
    s = Server(
        "--model", base, "--skip-tokenizer-init", "--tokenizer-worker-num", "2",
        "--enable-lora", "--max-lora-rank", "8",
    )  # fmt: skip
    try:
        loader = httpx.Client(timeout=120)
        r = loader.post(
            s.url + "/load_lora_adapter", json={"lora_name": "a", "lora_path": paths["a"]}
        )
        assert r.status_code == 200, r.text
        body = {"input_ids": PROMPTS[0], "sampling_params": GREEDY, "lora_path": "a"}

        def serves(c: httpx.Client, front_end: int) -> None:
            for _ in range(30):  # (a front end hears the scheduler's figures each second)
                r = c.post(s.url + "/generate", json=body)
                if r.status_code == 200:
                    break
                time.sleep(0.1)
            assert r.status_code == 200, (front_end, r.text)
            assert r.json()["output_ids"] == peft_ref("a", PROMPTS[0])[0]
            again = c.post(
                s.url + "/load_lora_adapter", json={"lora_name": "a", "lora_path": paths["a"]}
            )
            assert again.status_code == 400 and "already loaded" in again.text, again.text

        _on_each_front_end(s.url, 2, serves)
        # the other front end streams on the adapter: the unload is refused, the name stays
        mine = loader.get(s.url + "/server_info").json()["front_end"]
        for _ in range(400):
            other = httpx.Client(timeout=120)
            if other.get(s.url + "/server_info").json()["front_end"] != mine:
                break
            other.close()
        long = {**body, "sampling_params": {**GREEDY, "max_new_tokens": 249}, "stream": True}
        with other.stream("POST", s.url + "/generate", json=long) as stream:
            lines = stream.iter_lines()
            first = next(lines)
            assert first.startswith("data: {"), (stream.status_code, first, list(lines)[:3])
            r = loader.post(s.url + "/unload_lora_adapter", json={"lora_name": "a"})
            assert r.status_code == 400 and "in use by 1 request" in r.text, r.text
            assert loader.post(s.url + "/generate", json=body).status_code == 200
        other.close()
        for _ in range(50):  # (closed mid-stream: the request is aborted)
            r = loader.post(s.url + "/unload_lora_adapter", json={"lora_name": "a"})
            if r.status_code == 200:
                break
            time.sleep(0.1)
        assert r.status_code == 200, r.text
        loader.close()

        def refuses(c: httpx.Client, front_end: int) -> None:
            for _ in range(30):
                r = c.post(s.url + "/generate", json=body)
                if r.status_code == 400:
                    break
                time.sleep(0.1)
            assert r.status_code == 400 and "unknown LoRA adapter 'a'" in r.text, r.text

        _on_each_front_end(s.url, 2, refuses)
        assert _kv_balanced(s)
    finally:
        s.stop()


def _streams(url: str, per_front_end: int = 3) -> tuple[list[list], list[threading.Thread]]:
    """Long chat streams, ``per_front_end`` on each front end: each client asks which front end
    its connection reached, then streams on that same connection."""
    streams, threads, count = [], [], {0: 0, 1: 0}

    def stream(client: httpx.Client, out: list) -> None:
        try:
            _stream_events(url + CHAT, {**LONG, "stream": True}, out, client)
        finally:
            client.close()

    for _ in range(400):
        client = httpx.Client(timeout=60)
        front_end = client.get(url + "/server_info").json()["front_end"]
        if count[front_end] == per_front_end:
            client.close()
            continue
        count[front_end] += 1
        streams.append([])
        threads.append(threading.Thread(target=stream, args=(client, streams[-1])))
        threads[-1].start()
        if min(count.values()) == per_front_end:
            break
    assert min(count.values()) == per_front_end, count
    deadline = time.monotonic() + 60
    while not all(len(out) >= 3 for out in streams):
        assert time.monotonic() < deadline, [out[:3] for out in streams]
        time.sleep(0.05)
    return streams, threads


def _second_front_end_pid(s: Server) -> int:
    for _ in range(200):
        info = httpx.get(s.url + "/server_info", timeout=30).json()
        if info["front_end"] == 1:
            assert info["profile"]["front_pid"] in s.children
            return info["profile"]["front_pid"]
    raise AssertionError("front end 1 took no connection")


def _ends_in_error(events: list, phrase: str) -> bool:
    payloads = [json.loads(e) for e in events[1:] if e != "[DONE]" and e.startswith("{")]
    return any(phrase in json.dumps(p.get("error", "")) for p in payloads)


def _end_under_load(end) -> tuple[int, float, str, list[list], list[int]]:
    """A two-front-end server with three long streams on each, ended by ``end(server)``: its
    exit status, seconds from ``end`` to exit, output, the streams' events and its children."""
    s = Server("--tokenizer-worker-num", "2")
    try:
        streams, threads = _streams(s.url)
        children = s.children
        rc, exit_s, out = wait_exit(s, end(s), threads)
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
    time.sleep(0.5)
    return rc, exit_s, out, streams, children


def test_sigterm_under_load_ends_every_process_in_time():
    def sigterm(s: Server) -> float:
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        return t0

    rc, exit_s, out, streams, children = _end_under_load(sigterm)
    print(f"\nexit {exit_s:.2f} s after SIGTERM with 6 streams on 2 front ends")
    assert exit_s < 10 and rc in (0, -signal.SIGTERM), (rc, out[-2000:])
    assert not any(_alive(p) for p in children)
    for events in streams:
        assert events[-1] == "[DONE]" and _ends_in_error(events, "shutting down"), events[-3:]
    assert "Traceback" not in out, out[-3000:]


@pytest.mark.parametrize("victim", ["scheduler", "front end"])
def test_a_dead_process_ends_the_server_with_errors_in_time(victim):
    def kill(s: Server) -> float:
        pid = s.scheduler_pid if victim == "scheduler" else _second_front_end_pid(s)
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        return t0

    rc, exit_s, out, streams, children = _end_under_load(kill)
    print(f"\nexit {exit_s:.2f} s after the {victim} was killed")
    assert rc == 1 and exit_s < 10, (rc, out[-2000:])
    want = "scheduler process died" if victim == "scheduler" else "front-end process 1 exited"
    assert want in out, out[-2000:]
    assert not any(_alive(p) for p in children)
    # the streams of the killed front end are cut (its process is gone); every other stream
    # ends with an error event, none as a normal completion
    ended = [events for events in streams if events[-1] == "[DONE]"]
    assert ended, [events[-2:] for events in streams]
    for events in ended:
        assert _ends_in_error(events, "scheduler" if victim == "scheduler" else "shutting down")


def test_only_the_serve_backend_opens_slots_for_more_front_ends():
    """An offline engine with its scheduler in a process of its own has no front end to wait
    for, whatever ``tokenizer_worker_num`` says; ``loom serve``'s (``backend="serve"``) has."""
    import loom

    kw = dict(skip_tokenizer_init=True, max_total_tokens=512, tokenizer_worker_num=2)
    with loom.Engine(backend="process", **kw) as e:
        assert e.backend.slots == [] and e.info["front_ends"] == 1
        assert (
            len(
                e.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})["output_ids"]
            )
            == 2
        )
    with loom.Engine(backend="serve", **kw) as e:
        assert [slot.index for slot in e.backend.slots] == [1] and e.info["front_ends"] == 2
