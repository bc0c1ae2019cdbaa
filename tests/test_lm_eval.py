"""lm-evaluation-harness, a client no one here wrote, against a real ``loom serve``: its
``local-completions`` model (``loglikelihood`` through ``echo`` and prompt logprobs, and
``generate_until``) and its ``local-chat-completions`` model (``generate_until`` through the
chat template), on two small tasks defined here from local data (tests/data/lm_eval). The
oracle: the harness's own ``hf`` model on the same weights (transformers), whose scores and
per-question answers Loom's must equal.
"""

from __future__ import annotations

import pathlib

import pytest

from tests.test_server import Server

lm_eval = pytest.importorskip("lm_eval")

pytestmark = pytest.mark.slow

DATA = pathlib.Path(__file__).parent / "data" / "lm_eval"


def _task(name: str, data: str, **config) -> dict:
    return {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(DATA / data)}},
        "test_split": "test",
        **config,
    }


# Twelve questions of four choices: accuracy by summed and by length-normalised logprobs.
MULTIPLE_CHOICE = _task(
    "loom_facts_mc",
    "facts_mc.jsonl",
    output_type="multiple_choice",
    doc_to_text="Question: {{question}}\nAnswer:",
    doc_to_choice="{{choices}}",
    doc_to_target="{{gold}}",
    metric_list=[{"metric": "acc"}, {"metric": "acc_norm"}],
)

# Eight short answers, greedy until a newline, scored by exact match of the answer's last word
# ("2 + 3 = 5", "The capital of France is Paris.").
SHORT_ANSWERS = _task(
    "loom_short_answers",
    "short_answers.jsonl",
    output_type="generate_until",
    doc_to_text="Q: {{question}}\nA:",
    doc_to_target="{{answer}}",
    generation_kwargs={"until": ["\n"], "max_gen_toks": 16, "do_sample": False, "temperature": 0},
    filter_list=[
        {
            "name": "answer",
            "filter": [
                {"function": "regex", "regex_pattern": r"(\w+)\W*$"},
                {"function": "take_first"},
            ],
        }
    ],
    metric_list=[{"metric": "exact_match", "ignore_case": True, "ignore_punctuation": True}],
)


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def hf_lm(hf_model, hf_ref_dir):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=hf_model, tokenizer=hf_ref_dir, batch_size=1, max_length=2048)


def _evaluate(model, tasks: list[dict], **kwargs) -> dict:
    return lm_eval.simple_evaluate(model=model, tasks=tasks, bootstrap_iters=0, **kwargs)


def _answers(results: dict, task: str) -> list:
    """Per question (in document order): the model's responses before filtering."""
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    return [s["resps"] for s in samples]


def _scores(results: dict, task: str) -> dict:
    return {k: v for k, v in results["results"][task].items() if "," in k and "stderr" not in k}


def test_local_completions_equals_hf(server, hf_lm, hf_ref_dir):
    loom = _evaluate(
        "local-completions",
        [MULTIPLE_CHOICE, SHORT_ANSWERS],
        model_args={
            "model": "smollm2-135m-instruct",
            "base_url": server.url + "/v1/completions",
            "tokenizer_backend": "huggingface",
            "tokenizer": hf_ref_dir,
            "num_concurrent": 4,
            "max_retries": 1,
        },
    )
    hf = _evaluate(hf_lm, [MULTIPLE_CHOICE, SHORT_ANSWERS])
    mc = "loom_facts_mc"
    assert _scores(loom, mc) == _scores(hf, mc)
    assert _scores(loom, mc)["acc,none"] > 0.5  # the questions are easy: chance is 0.25
    for got, want in zip(_answers(loom, mc), _answers(hf, mc), strict=True):
        for (lp, greedy), (lp_hf, greedy_hf) in zip(
            (r[0] for r in got), (r[0] for r in want), strict=True
        ):
            assert lp == pytest.approx(lp_hf, abs=2e-3)
            assert greedy == greedy_hf
    gen = "loom_short_answers"
    assert _answers(loom, gen) == _answers(hf, gen)
    assert _scores(loom, gen) == _scores(hf, gen)
    assert _scores(loom, gen)["exact_match,answer"] > 0


def test_local_chat_completions_equals_hf(server, hf_lm):
    loom = _evaluate(
        "local-chat-completions",
        [SHORT_ANSWERS],
        model_args={
            "model": "smollm2-135m-instruct",
            "base_url": server.url + "/v1/chat/completions",
            "num_concurrent": 4,
            "max_retries": 1,
        },
        apply_chat_template=True,
    )
    hf = _evaluate(hf_lm, [SHORT_ANSWERS], apply_chat_template=True)
    gen = "loom_short_answers"
    assert _answers(loom, gen) == _answers(hf, gen)
    assert all(a[0] for a in _answers(loom, gen))
    assert _scores(loom, gen) == _scores(hf, gen)
