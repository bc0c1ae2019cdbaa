"""SGLang's frontend language (``sgl.function`` programs on ``sgl.RuntimeEndpoint``), a client no
one here wrote, run against a real ``loom serve``: ``gen`` in chat and multi-turn, ``run_batch``,
``select`` among choices by prompt logprobs, ``regex``, ``fork``. The oracles: Loom's engine on
the exact text the frontend sent (itself at parity with transformers), transformers for the
logprobs ``select`` decides by, and the regex itself.

The frontend's modules are imported under their real names without running
``sglang/__init__.py`` (which imports SGLang's runtime and patches transformers), as in
tests/test_sglang_compat.py; ``make setup`` installs the few packages they import.
"""

from __future__ import annotations

import re

import pytest
import torch

from tests.test_server import Server
from tests.test_sglang_compat import sglang_module

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sgl():
    api = sglang_module("sglang.lang.api")
    endpoint = sglang_module("sglang.lang.backend.runtime_endpoint")
    s = Server()
    # SmolLM2-Instruct is trained on ChatML; the frontend picks a template from the model path,
    # and knows no GGUF file's name
    api.set_default_backend(endpoint.RuntimeEndpoint(s.url, chat_template_name="chatml"))
    yield api
    api.set_default_backend(None)
    s.stop()


def greedy(engine, text: str, max_new_tokens: int, **params) -> str:
    params = {"max_new_tokens": max_new_tokens, "temperature": 0, **params}
    return engine.generate(prompt=text, sampling_params=params)["text"]


def test_gen_in_chat_and_multi_turn(sgl, engine):
    @sgl.function
    def multi_turn(s, first, second):
        s += sgl.user(first)
        s += sgl.assistant(sgl.gen("a1", max_tokens=16, temperature=0))
        s += sgl.user(second)
        s += sgl.assistant(sgl.gen("a2", max_tokens=16, temperature=0))

    state = multi_turn.run(first="What is the capital of France?", second="And of Germany?")
    text = state.text()
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in text
    assert state["a1"] == "The capital of France is Paris."
    # each answer is what the engine generates from the text before it
    before_a1 = text[: text.index(state["a1"])]
    assert state["a1"] == greedy(engine, before_a1, 16)
    before_a2 = text[: text.rindex(state["a2"])]
    assert state["a2"] == greedy(engine, before_a2, 16)
    assert state["a2"] and state["a2"] != state["a1"]


def test_run_batch_equals_runs_one_by_one(sgl):
    @sgl.function
    def qa(s, q):
        s += sgl.user(q)
        s += sgl.assistant(sgl.gen("answer", max_tokens=12, temperature=0))

    qs = [{"q": "What is 2+2?"}, {"q": "Name a color."}, {"q": "What is the capital of Italy?"}]
    batch = qa.run_batch(qs, num_threads=3)
    one_by_one = [qa.run(**q)["answer"] for q in qs]
    assert [st["answer"] for st in batch] == one_by_one
    assert len(set(one_by_one)) == 3


def test_select_by_prompt_logprobs_matches_transformers(sgl, engine, hf_model):
    @sgl.function
    def pick(s):
        s += "The capital of France is" + sgl.select("city", choices=[" Paris", " London", " Rome"])

    state = pick.run()
    assert state["city"] == " Paris"
    meta = state.get_meta_info("city")
    tok = engine.tokenizer
    for choice, entries in zip(
        [" Paris", " London", " Rome"], meta["input_token_logprobs"], strict=True
    ):
        ids = tok.encode("The capital of France is" + choice, add_special_tokens=False)
        with torch.no_grad():
            lsm = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)
        # the entries are the prompt's last tokens: token q's logprob comes from position q - 1
        tail = ids[len(ids) - len(entries) :]
        assert [e[1] for e in entries] == tail
        want = [lsm[len(ids) - len(entries) + i - 1, t].item() for i, t in enumerate(tail)]
        assert [e[0] for e in entries] == pytest.approx(want, abs=2e-3)
    scores = meta["normalized_prompt_logprobs"]
    assert scores.index(max(scores)) == 0


def test_regex_constrained_gen(sgl):
    @sgl.function
    def phone(s):
        s += "My phone number is " + sgl.gen("num", max_tokens=16, regex=r"\d{3}-\d{4}")

    for _ in range(3):  # sampled (temperature 1): the regex holds for every draw
        assert re.fullmatch(r"\d{3}-\d{4}", phone.run()["num"])


def test_fork_branches_continue_the_same_state(sgl, engine):
    @sgl.function
    def facts(s):
        s += "Two facts about cats:\n"
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f"{i + 1}." + sgl.gen("fact", max_tokens=12, temperature=0, stop="\n")
        forks.join()
        s += "A:" + forks[0]["fact"] + "\nB:" + forks[1]["fact"]

    state = facts.run()
    a, b = state.text().split("\n")[1:3]
    for i, line in enumerate((a, b)):
        fact = line[2:]
        want = greedy(engine, f"Two facts about cats:\n{i + 1}.", 12, stop="\n")
        assert fact == want and fact
