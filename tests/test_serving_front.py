"""The serving front end at speed: incremental /generate streams, pending outputs coalesced into
one increment, the front end's profile, and `loom bench serving` (every endpoint, several
worker processes) against a live `loom serve`; its stream parser on bytes split anywhere."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time

import pytest

from loom.bench.serving_client import StreamParser
from tests.conftest import http_get, http_post, http_stream
from tests.test_server import Server

SP = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server():
    s = Server("--incremental-streaming-output")
    yield s
    s.stop()


def _events(url: str, body: dict) -> list[dict]:
    with http_stream("POST", url, json=body, timeout=120) as r:
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln[6:]) for ln in lines[:-1]]


def test_incremental_generate_stream_equals_the_whole_answer(server):
    url = server.url + "/generate"
    body = {"text": "The three primary colours are", "sampling_params": SP, "return_logprob": True}
    whole = http_post(url, json=body).json()
    chunks = _events(url, {**body, "stream": True})
    assert "".join(c["text"] for c in chunks) == whole["text"]
    ids = [i for c in chunks for i in c["output_ids"]]
    assert ids == whole["output_ids"] and len(ids) == SP["max_new_tokens"]
    seen = 0
    for c in chunks:  # completion_tokens stays cumulative; ids and logprobs are per chunk
        seen += len(c["output_ids"])
        assert c["meta_info"]["completion_tokens"] == seen
        assert len(c["meta_info"]["output_token_logprobs"]) == len(c["output_ids"])
    lps = [e for c in chunks for e in c["meta_info"]["output_token_logprobs"]]
    assert [(i, t) for _, i, t in lps] == [
        (i, t) for _, i, t in whole["meta_info"]["output_token_logprobs"]
    ]
    for (a, _, _), (b, _, _) in zip(lps, whole["meta_info"]["output_token_logprobs"], strict=True):
        assert a == pytest.approx(b, abs=1e-4)


def test_sglang_fields_that_loom_accepts(server):
    url = server.url + "/generate"
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
    assert http_post(url, json={**body, "return_routed_experts": False}).status_code == 200
    r = http_post(url, json={**body, "return_routed_experts": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_routed_experts"


def test_profile_counts_the_front_ends_work(server):
    before = http_get(server.url + "/server_info").json()["profile"]
    http_post(server.url + "/generate", json={"text": "Hi", "sampling_params": SP, "stream": True})
    after = http_get(server.url + "/server_info").json()["profile"]
    assert after["detokenized_tokens"] - before["detokenized_tokens"] == SP["max_new_tokens"]
    assert after["outputs"] > before["outputs"] and after["sse_events"] > before["sse_events"]
    assert after["output_messages"] > before["output_messages"]
    assert after["scheduler_cpu_s"] > 0 and after["front_cpu_s"] > before["front_cpu_s"]
    assert after["front_pid"] != http_get(server.url + "/server_info").json()["scheduler_pid"]


def _bench(server, tmp_path, *flags: str) -> list[dict]:
    out = tmp_path / "serving.jsonl"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "loom.cli",
            "bench",
            "serving",
            "--base-url",
            server.url,
            "--num-prompts",
            "6",
            "--random-input-len",
            "16",
            "--random-output-len",
            "10",
            "--num-workers",
            "2",
            "--result-file",
            str(out),
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "client the limit?" in proc.stdout and "server CPU per process" in proc.stdout
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.mark.parametrize("backend", ["generate", "completions", "chat"])
def test_bench_serving_counts_every_token(server, tmp_path, backend):
    (r,) = _bench(server, tmp_path, "--backend", backend)
    assert r["completed"] == 6 and r["errors"] == 0
    assert r["output_tokens"] == 60  # ignore_eos: every request ran to its length
    assert r["input_tokens"] >= 6 * 16
    assert r["num_workers"] == 2 and len(r["client_cpu"]) == 2
    assert 0 < r["ttft_p50_ms"] <= r["e2e_p50_ms"]
    assert r["server"]["detokenized_tokens"] >= 60 and r["server"]["sse_events"] >= 6
    assert r["engine"]["decode_steps"] >= 9 and r["engine"]["step_ms"] > 0


def test_bench_serving_scaling_check(server, tmp_path):
    first, second = _bench(server, tmp_path, "--scaling-check")
    assert first["num_workers"] == 2 and second["num_workers"] == 4
    assert first["output_tokens"] == second["output_tokens"] == 60
    assert "scaling_change" in second


def test_stream_coalesces_what_is_pending(engine):
    """A reader that falls behind gets everything pending as one increment, equal to what it
    would have read token by token."""
    sp = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    prompt = "List some fruits:"
    whole = engine.generate(prompt, sp, return_logprob=True, top_logprobs_num=2)
    stream = engine.generate(
        prompt, sp, stream=True, rid="slow-reader", return_logprob=True, top_logprobs_num=2
    )
    deadline = time.time() + 60
    while engine.router.states["slow-reader"].finish_time is None and time.time() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)  # (the finish time is stamped just before the last output is queued)
    incs = list(stream)
    assert len(incs) == 1
    (inc,) = incs
    assert inc["text"] == whole["text"] and inc["output_ids"] == whole["output_ids"]
    meta, ref = inc["meta_info"], whole["meta_info"]
    assert [i for _, i, _ in meta["output_token_logprobs"]] == whole["output_ids"]
    assert len(meta["output_top_logprobs"]) == len(ref["output_top_logprobs"]) == 16
    assert meta["finish_reason"] == ref["finish_reason"]


def _generate_events(ids: list[int], cumulative: bool, prompt_tokens: int = 5) -> bytes:
    """An SSE body as /generate streams it, each event with one new token."""
    body = b""
    for k in range(1, len(ids) + 1):
        out = ids[:k] if cumulative else ids[k - 1 : k]
        meta = {"completion_tokens": k, "prompt_tokens": prompt_tokens}
        body += b"data: " + json.dumps({"text": "x", "output_ids": out, "meta_info": meta}).encode()
        body += b"\n\n"
    return body + b"data: [DONE]\n\n"


@pytest.mark.parametrize("cumulative", [True, False])
def test_stream_parser_on_bytes_split_anywhere(cumulative):
    ids = list(range(100, 140))
    data = _generate_events(ids, cumulative)
    rng = random.Random(0)
    for _ in range(20):
        p = StreamParser("generate")
        cuts = sorted(rng.sample(range(1, len(data)), 30))
        for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True):
            p.feed(data[a:b], float(a))
        assert p.done and p.error is None
        assert p.tokens == 40 and sum(p.chunk_tokens) == 40 and p.prompt_tokens == 5
        assert len(p.chunk_times) == 40 and p.chunk_times == sorted(p.chunk_times)


def test_stream_parser_openai_usage_and_errors():
    chunk = {"choices": [{"index": 0, "text": "ab", "finish_reason": None}]}
    usage = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}
    body = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in (chunk, chunk, usage))
    p = StreamParser("completions")
    p.feed(body + b"data: [DONE]\n\n", 1.0)
    assert (p.tokens, p.prompt_tokens, len(p.chunk_times), p.done) == (3, 7, 2, True)
    p = StreamParser("chat")
    p.feed(b'data: {"error": {"message": "boom", "type": "x"}}\n\ndata: [DONE]\n\n', 1.0)
    assert p.error == "error event: boom"


def test_consumer_merges_pending_outputs_up_to_the_finishing_one():
    """An engine failure's abort can queue behind a request's last output: it is not merged in."""
    import queue

    from loom.engine.outputs import OutputConsumer, ReqState
    from loom.engine.profile import FrontendProfile
    from loom.sampling.sampling_params import SamplingParams
    from loom.scheduler.messages import ReqOutput

    forgotten: list[str] = []
    consume = OutputConsumer(None, lambda rid: None, forgotten.append, FrontendProfile())
    st = ReqState("r", 3, SamplingParams(), queue.Queue())
    lp = {"output_token_logprobs": [(-0.5, 5)]}
    outs = [
        ReqOutput("r", [5], 3, 1, extra=lp),
        ReqOutput("r", [6], 3, 2, finished_reason={"type": "length", "length": 2}),
        ReqOutput("r", [], 3, 2, finished_reason={"type": "abort", "message": "x"}, error="x"),
    ]
    inc = consume(st, outs)
    assert inc["output_ids"] == [5, 6] and st.output_ids == [5, 6]
    assert inc["meta_info"]["finish_reason"]["type"] == "length"
    assert "error" not in inc["meta_info"] and forgotten == ["r"] and st.finished


def test_a_steps_outputs_cross_the_process_boundary_unchanged():
    """A step's outputs pickle as rows of fields (the scheduler's wire form) and come back as
    equal ``ReqOutput``s: tokens, finish reasons, errors, logprob extras, stats and time."""
    import dataclasses
    import pickle

    from loom.scheduler.messages import ReqOutput, SchedulerBatchOut

    outs = [
        ReqOutput("a", [5, 6], 10, 2, cached_tokens=4),
        ReqOutput("b", [7], 3, 1, finished_reason={"type": "length", "length": 1}),
        ReqOutput("c", [], 0, 0, finished_reason={"type": "abort"}, error="bad request"),
        ReqOutput("d", [9], 2, 1, extra={"output_token_logprobs": [(-0.5, 9)]}),
    ]
    batch = SchedulerBatchOut(outs, {"num_running_reqs": 3, "step_hist_decode": [0, 2]}, 12.5)
    back = pickle.loads(pickle.dumps(batch))
    assert back == batch
    assert all(type(o) is ReqOutput for o in back.outputs)
    assert back.outputs[0].extra is not back.outputs[1].extra  # each output its own dict
    # every field crosses, whatever its value (a field the wire form left out would not)
    for f in dataclasses.fields(ReqOutput):
        out = ReqOutput("e", [1], 1, 1)
        setattr(out, f.name, ("sentinel", f.name))
        assert pickle.loads(pickle.dumps(SchedulerBatchOut([out]))).outputs == [out], f.name


def test_ending_every_request_delivers_the_error_before_the_schedulers_abort():
    """Shutdown's ``end_all`` runs on a timer thread and queues each request's error on its
    event loop; the scheduler's reply to the abort it sends (a plain abort) can be drained on
    that loop before the error's callback runs. The client must still get the error."""
    import asyncio

    from loom.engine.outputs import ReqState
    from loom.engine.router import OutputRouter
    from loom.sampling.sampling_params import SamplingParams
    from loom.scheduler.messages import ReqOutput, SchedulerBatchOut

    released: list[str] = []

    async def main() -> list[ReqOutput]:
        loop = asyncio.get_running_loop()
        router = OutputRouter()
        router.lora_release = released.append
        st = ReqState("r", 3, SamplingParams(), asyncio.Queue(), loop=loop, lora_id="ad")
        router.register(st)
        router.on_batch(SchedulerBatchOut([ReqOutput("r", [5], 3, 1)]))

        def scheduler_replies(rid: str) -> None:  # drained on the loop at once
            out = ReqOutput(rid, [], 3, 1, finished_reason={"type": "abort"})
            router.on_batch(SchedulerBatchOut([out]))

        assert router.end_all("the server is shutting down", 503, scheduler_replies) == 1
        await asyncio.sleep(0)
        return [st.outputs.get_nowait() for _ in range(st.outputs.qsize())]

    got = asyncio.run(main())
    assert [o.new_token_ids for o in got] == [[5], []], got
    assert got[-1].error == "the server is shutting down"
    assert got[-1].finished_reason["status_code"] == 503
    assert released == ["ad"]  # the adapter's reference, once
