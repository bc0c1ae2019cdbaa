"""Issue 7's sampling parameters against references: the filtered softmax (chi-square), plain
penalty formulas and HF's repetition-penalty processor, HF's log_softmax for logprobs, and
behaviour through the Engine (min_new_tokens, ignore_eos, stop strings, n, processors)."""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

import loom
from loom.sampling.penalties import PenaltyState
from loom.sampling.sampler import SamplingBatchInfo, sample
from loom.sampling.sampling_params import SamplingParams
from tests.conftest import chat_ids, save_tiny_llama

# ---- the sampler against the filtered softmax ----------------------------------------------

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.6, 0.0, -0.5, -1.0, -2.0, -3.0, -5.0])


def _filtered(logits, t, k, p, m):
    """The reference: softmax at temperature t, then keep top-k, the smallest prefix whose mass
    reaches p, and tokens with prob >= m * max (the top token always stays)."""
    probs = torch.softmax(logits / t, -1).tolist()
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    keep, mass = [], 0.0
    for rank, i in enumerate(order):
        if rank >= k > 0:
            break
        if rank > 0 and mass >= p:
            break
        if probs[i] < m * probs[order[0]] and rank > 0:
            break
        keep.append(i)
        mass += probs[i]
    out = torch.zeros(len(probs), dtype=torch.float64)
    for i in keep:
        out[i] = probs[i]
    return out / out.sum()


def _chi2_p(counts: torch.Tensor, expected: torch.Tensor) -> float:
    stat = (((counts - expected) ** 2) / expected).sum()
    df = torch.tensor(len(counts) - 1, dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))


@pytest.mark.parametrize(
    "t,k,p,m",
    [(1.0, -1, 1.0, 0.0), (0.7, -1, 1.0, 0.0), (1.0, 3, 1.0, 0.0), (1.0, -1, 0.8, 0.0),
     (1.0, -1, 1.0, 0.2), (1.3, 5, 0.9, 0.05)],
)  # fmt: skip
def test_20000_samples_follow_the_filtered_softmax(t, k, p, m):
    n = 20000
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)] * n
    info = SamplingBatchInfo.build(params, [0] * n, len(LOGITS), torch.device("cpu"))
    torch.manual_seed(1234)
    draws = sample(LOGITS.expand(n, -1).clone(), info)
    counts = torch.bincount(draws, minlength=len(LOGITS)).double()
    expected = _filtered(LOGITS, t, k, p, m) * n
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a filtered-out token was sampled"
    assert _chi2_p(counts[keep], expected[keep]) > 1e-3


@pytest.mark.parametrize(
    "t,k,p,m", [(1.0, -1, 0.9, 0.0), (0.8, 50, 1.0, 0.0), (1.0, -1, 1.0, 0.05)]
)
def test_the_cpu_candidate_path_samples_the_same_distribution(t, k, p, m):
    """A 3,000-token vocabulary whose mass sits in 12 tokens: rows are bounded within the top
    1,024 candidates (loom.sampling.sampler.CANDIDATES) and take the partial path."""
    from loom.sampling import sampler

    logits = torch.full((3000,), -12.0)
    logits[:10] = LOGITS
    logits[1500] = 1.2
    logits[2999] = 0.3
    n = 20000
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)] * n
    info = SamplingBatchInfo.build(params, [0] * n, 3000, torch.device("cpu"))
    assert 3000 > sampler.CANDIDATES
    torch.manual_seed(99)
    draws = sample(logits.expand(n, -1).clone(), info)
    counts = torch.bincount(draws, minlength=3000).double()
    expected = _filtered(logits, t, k, p, m) * n
    keep = expected > 5  # chi-square needs expected counts of a few; pool the tail
    tail_exp, tail_got = expected[~keep].sum(), counts[~keep].sum()
    obs = torch.cat([counts[keep], tail_got.view(1)])
    exp = torch.cat([expected[keep], tail_exp.view(1)])
    if tail_exp < 5:
        assert tail_got <= 20
        obs, exp = counts[keep], expected[keep] * (counts[keep].sum() / expected[keep].sum())
    assert _chi2_p(obs, exp) > 1e-3


@pytest.mark.parametrize(
    "t,k,p,m",
    [(1.0, -1, 0.9, 0.0), (1.0, 1500, 1.0, 0.0), (1.0, -1, 1.0, 0.5), (0.9, 2000, 0.8, 0.3)],
)
def test_the_cpu_rejection_path_samples_the_same_distribution(t, k, p, m):
    """A flat 3,000-token distribution: the filtered set reaches past the top 1,024, so rows
    draw from the whole softmax and redraw excluded tokens (rejection)."""
    logits = torch.linspace(-1.5, 1.5, 3000)[
        torch.randperm(3000, generator=torch.Generator().manual_seed(1))
    ]
    n = 20000
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)] * n
    info = SamplingBatchInfo.build(params, [0] * n, 3000, torch.device("cpu"))
    torch.manual_seed(5)
    draws = sample(logits.expand(n, -1).clone(), info)
    expected = _filtered(logits, t, k, p, m) * n
    counts = torch.bincount(draws, minlength=3000).double()
    assert counts[expected == 0].sum() == 0, "an excluded token was sampled"
    order = expected.argsort(descending=True)
    kept = int((expected > 0).sum())
    bins = torch.arange(kept) * 40 // kept  # 40 bins of tokens by expected probability
    obs = torch.zeros(40, dtype=torch.float64).index_add_(0, bins, counts[order[:kept]])
    exp = torch.zeros(40, dtype=torch.float64).index_add_(0, bins, expected[order[:kept]])
    assert _chi2_p(obs, exp) > 1e-3


# ---- penalties against plain references ------------------------------------------------------


@pytest.mark.parametrize("path", ["sparse", "dense", "kernel"])
def test_penalties_match_the_formulas_and_hf(path):
    """The CPU (sparse), plain-PyTorch dense and Triton kernel paths (CPU: Triton's
    interpreter) against the formulas and HF's repetition penalty."""
    if path == "kernel" and importlib.util.find_spec("triton") is None:
        pytest.skip("needs triton")
    from transformers import RepetitionPenaltyLogitsProcessor

    rng = random.Random(0)
    vocab = 50
    state = PenaltyState(vocab, torch.device("cpu"), capacity=2)
    prompts = [[rng.randrange(vocab) for _ in range(8)] for _ in range(3)]
    outputs = [[rng.randrange(vocab) for _ in range(12)] for _ in range(3)]
    rows = [state.alloc(p) for p in prompts]  # grows past its capacity of 2
    for r, out in zip(rows, outputs, strict=True):
        for t in out:
            state.add(torch.tensor([r]), torch.tensor([t]))
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    freq, pres, rep = [0.5, 0.0, 1.2], [0.3, -0.4, 0.0], [1.0, 1.3, 0.8]
    from loom.sampling import penalties

    got = logits.clone()
    fn = {
        "sparse": penalties._apply_sparse,
        "dense": penalties._apply_dense,
        "kernel": penalties._apply_kernel,
    }[path]
    fn(
        got, torch.tensor([0, 1, 2]), torch.tensor(rows), state,
        torch.tensor(freq), torch.tensor(pres), torch.tensor(rep),
    )  # fmt: skip
    want = logits.clone()
    for i in range(3):
        for tok in range(vocab):
            c = outputs[i].count(tok)
            want[i, tok] -= freq[i] * c + pres[i] * (c > 0)
    for i in range(3):  # HF's processor over prompt + output, on the row after f/p
        hist = torch.tensor([prompts[i] + outputs[i]])
        want[i : i + 1] = RepetitionPenaltyLogitsProcessor(rep[i])(hist, want[i : i + 1])
    torch.testing.assert_close(got, want)
    state.release(rows[0])
    assert state.alloc([1]) == rows[0] and int(state.counts[rows[0]].sum()) == 0


# ---- through the engine ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-sampling"), initializer_range=0.2)


def test_logprobs_equal_hf_log_softmax(engine, hf_model):
    """Output (chosen, top-5 and chosen ids') and prompt logprobs against HF's logits on the
    same ids."""
    ids = chat_ids(engine, "Name a fruit.")
    probe = [ids[1], 0, 42, 42, engine.vocab_size - 1]  # (a repeat is answered twice)
    out = engine.generate(
        input_ids=ids,
        sampling_params={"max_new_tokens": 6, "temperature": 0},
        return_logprob=True,
        top_logprobs_num=5,
        logprob_start_len=0,
        token_ids_logprob=probe,
    )
    meta = out["meta_info"]
    full = ids + out["output_ids"]
    with torch.no_grad():
        lsm = torch.log_softmax(hf_model(torch.tensor([full])).logits[0].float(), -1)
    for j, (lp, tok, text) in enumerate(meta["output_token_logprobs"]):
        pos = len(ids) - 1 + j
        assert tok == out["output_ids"][j] and text == engine.tokenizer.decode([tok])
        assert abs(lp - lsm[pos, tok].item()) < 1e-3
        top_v, top_i = lsm[pos].topk(5)
        assert [t for _, t, _ in meta["output_top_logprobs"][j]] == top_i.tolist()
        for (v, _, _), ref in zip(meta["output_top_logprobs"][j], top_v.tolist(), strict=True):
            assert abs(v - ref) < 1e-3
        chosen = meta["output_token_ids_logprobs"][j]
        assert [t for _, t, _ in chosen] == probe
        assert [v for v, _, _ in chosen] == pytest.approx(lsm[pos, probe].tolist(), abs=1e-3)
    assert len(meta["output_token_ids_logprobs"]) == len(out["output_ids"])
    inp_chosen = meta["input_token_ids_logprobs"]
    assert len(inp_chosen) == len(ids) and inp_chosen[0] is None
    for q in range(1, len(ids)):
        assert [t for _, t, _ in inp_chosen[q]] == probe
        assert [v for v, _, _ in inp_chosen[q]] == pytest.approx(
            lsm[q - 1, probe].tolist(), abs=1e-3
        )
    inp = meta["input_token_logprobs"]
    assert len(inp) == len(ids) and inp[0][0] is None and inp[0][1] == ids[0]
    for q in range(1, len(ids)):
        assert inp[q][1] == ids[q] and abs(inp[q][0] - lsm[q - 1, ids[q]].item()) < 1e-3
    # the prompt's top entries (OpenAI's echo with logprobs, lm-eval's greedy check)
    tops = meta["input_top_logprobs"]
    assert len(tops) == len(ids) and tops[0] is None
    for q in range(1, len(ids)):
        top_v, top_i = lsm[q - 1].topk(5)
        assert [t for _, t, _ in tops[q]] == top_i.tolist()
        assert [v for v, _, _ in tops[q]] == pytest.approx(top_v.tolist(), abs=1e-3)
    # nothing to generate: the prompt is only scored (SGLang's `select`), no token comes out
    scored = engine.generate(
        input_ids=ids,
        sampling_params={"max_new_tokens": 0},
        return_logprob=True,
        logprob_start_len=0,
    )
    assert scored["output_ids"] == [] and scored["text"] == ""
    assert scored["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert [(lp, t) for lp, t, _ in scored["meta_info"]["input_token_logprobs"]] == [
        (lp, t) for lp, t, _ in inp
    ]
    # logprob_start_len skips the first prompt tokens (and still lets the cache serve them)
    again = engine.generate(
        input_ids=ids,
        sampling_params={"max_new_tokens": 1, "temperature": 0},
        return_logprob=True,
        logprob_start_len=len(ids) - 3,
    )
    tail = again["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in tail] == ids[-3:]
    assert again["meta_info"]["cached_tokens"] > 0


def test_min_new_tokens_suppresses_eos_and_ignore_eos_runs_to_the_limit(engine):
    ids = chat_ids(engine, "What is the capital of France?")
    short = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 64, "temperature": 0})
    assert short["meta_info"]["finish_reason"]["type"] == "stop"
    n = short["meta_info"]["completion_tokens"]
    longer = engine.generate(
        input_ids=ids,
        sampling_params={"max_new_tokens": 64, "temperature": 0, "min_new_tokens": n + 5},
    )
    assert longer["meta_info"]["completion_tokens"] >= n + 5
    assert longer["output_ids"][: n - 1] == short["output_ids"][: n - 1]
    full = engine.generate(
        input_ids=ids, sampling_params={"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
    )
    assert full["meta_info"]["completion_tokens"] == 40
    assert full["meta_info"]["finish_reason"] == {"type": "length", "length": 40}


def test_stop_strings_across_tokens_and_no_stop_trim(engine):
    ids = chat_ids(engine, "What is the capital of France?")
    ref = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 16, "temperature": 0})
    text = ref["text"]  # "The capital of France is Paris."
    stop = "ital of Fr"  # spans several tokens
    assert stop in text
    cut = engine.generate(
        input_ids=ids, sampling_params={"max_new_tokens": 16, "temperature": 0, "stop": stop}
    )
    assert cut["text"] == text[: text.index(stop)]
    kept = engine.generate(
        input_ids=ids,
        sampling_params={
            "max_new_tokens": 16,
            "temperature": 0,
            "stop": stop,
            "no_stop_trim": True,
        },
    )
    assert kept["text"] == text[: text.index(stop) + len(stop)]
    assert kept["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_logit_bias_and_penalties_change_greedy_output_as_expected(engine):
    ids = chat_ids(engine, "Count from one to ten.")
    base = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 12, "temperature": 0})
    first = base["output_ids"][0]
    banned = engine.generate(
        input_ids=ids,
        sampling_params={"max_new_tokens": 12, "temperature": 0, "logit_bias": {str(first): -100}},
    )
    assert banned["output_ids"][0] != first
    forced = engine.generate(
        input_ids=ids,
        sampling_params={"max_new_tokens": 3, "temperature": 0, "logit_bias": {"42": 100}},
    )
    assert forced["output_ids"] == [42, 42, 42]
    rep = engine.generate(
        input_ids=ids,
        sampling_params={"max_new_tokens": 24, "temperature": 0, "presence_penalty": 2.0},
    )
    toks = rep["output_ids"]
    assert len(set(toks)) > len(set(base["output_ids"])) or len(set(toks)) == len(toks)


def test_n_samples_share_the_prompt_kv(tiny):
    rng = random.Random(5)
    prompt = [rng.randrange(3, 500) for _ in range(40)]
    with loom.Engine(model=tiny, skip_tokenizer_init=True, max_total_tokens=4096) as e:
        outs = e.generate(
            input_ids=prompt,
            sampling_params={"max_new_tokens": 12, "temperature": 1.0, "n": 4, "ignore_eos": True},
        )
        e.scheduler.check_kv_balance()
    assert len(outs) == 4
    assert len({tuple(o["output_ids"]) for o in outs}) == 4  # four distinct samples
    cached = sorted(o["meta_info"]["cached_tokens"] for o in outs)
    assert cached[0] == 0 and cached[1:] == [39, 39, 39]  # prefilled once, then shared


def test_processors_thinking_budget_and_no_repeat_ngram(engine):
    from transformers import NoRepeatNGramLogitsProcessor

    from loom.sampling.logits_processor import NoRepeatNGramProcessor, TokenHistory

    hist = [1, 2, 3, 1, 2, 4, 1, 2]
    logits = torch.randn(1, 10, generator=torch.Generator().manual_seed(3))
    got = NoRepeatNGramProcessor()(
        logits.clone(), [{"n": 3}], [TokenHistory.of(hist[:3], hist[3:])]
    )
    want = NoRepeatNGramLogitsProcessor(3)(torch.tensor([hist]), logits.clone())
    torch.testing.assert_close(got, want)
    ids = chat_ids(engine, "Think step by step: what is 3 + 4?")
    end = engine.tokenizer.encode(" </done>", add_special_tokens=False)
    out = engine.generate(
        input_ids=ids,
        sampling_params={
            "max_new_tokens": 12,
            "temperature": 0,
            "ignore_eos": True,
            "custom_logit_processor": "thinking_budget",
            "custom_params": {"budget": 5, "think_end_ids": end},
        },
    )
    assert out["output_ids"][5 : 5 + len(end)] == end


def test_bad_values_name_the_field(engine):
    for params, field in [
        ({"frequency_penalty": 3}, "frequency_penalty"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_new_tokens": -1}, "min_new_tokens"),
        ({"min_new_tokens": 10, "max_new_tokens": 5}, "min_new_tokens"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 500}}, "logit_bias"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),
        ({"n": 0}, "n"),
        ({"custom_logit_processor": '{"callable": "00"}'}, "custom_logit_processor"),
    ]:
        with pytest.raises(ValueError, match=field):
            engine.generate(prompt="hi", sampling_params=params)
    with pytest.raises(ValueError, match="top_logprobs_num"):
        engine.generate(prompt="hi", top_logprobs_num=3)
    with pytest.raises(ValueError, match="token_ids_logprob"):
        engine.generate(prompt="hi", token_ids_logprob=[1])  # (no return_logprob)
    for bad in ([engine.vocab_size], [-1], ["7"], [[1, 2]], list(range(1025))):
        with pytest.raises(ValueError, match="token_ids_logprob"):
            engine.generate(prompt="hi", return_logprob=True, token_ids_logprob=bad)
