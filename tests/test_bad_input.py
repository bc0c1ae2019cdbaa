from __future__ import annotations

import pytest

BAD = [
    ({"prompt": ""}, "empty"),
    ({"prompt": "hi", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ({"prompt": "hi", "sampling_params": {"temperature": -0.5}}, "temperature"),
    ({"prompt": "hi", "sampling_params": {"top_p": 0}}, "top_p"),
    ({"prompt": "hi", "sampling_params": {"top_p": 1.5}}, "top_p"),
    ({"prompt": "hi", "sampling_params": {"top_k": 0}}, "top_k"),
    ({"prompt": "hi", "sampling_params": {"min_p": 2}}, "min_p"),
    ({"prompt": "hi", "sampling_params": {"bogus": 1}}, "bogus"),
    ({"prompt": "hi", "sampling_params": {"frequency_penalty": 2.5}}, "frequency_penalty"),
    ({"prompt": "hi", "sampling_params": {"custom_logit_processor": "nope"}}, "nope"),
    ({"input_ids": [10**9]}, "input_ids"),
    ({"input_ids": []}, "empty"),
]


@pytest.mark.parametrize("kwargs,needle", BAD, ids=[b[1] for b in BAD])
def test_bad_input_raises_and_engine_keeps_serving(engine, kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        engine.generate(**kwargs)
    out = engine.generate("Hello", {"max_new_tokens": 2, "temperature": 0})
    assert out["meta_info"]["completion_tokens"] == 2


def test_prompt_longer_than_context(engine):
    n = engine.context_len
    with pytest.raises(ValueError, match=f"{n}"):
        engine.generate(input_ids=[100] * n)
    assert engine.generate("Hi", {"max_new_tokens": 1})["meta_info"]["completion_tokens"] == 1


def test_bad_item_in_batch_rejects_whole_batch_before_submitting(engine):
    with pytest.raises(ValueError, match="temperature"):
        engine.generate(["a", "b"], [{"max_new_tokens": 1}, {"temperature": -1}])
    engine.scheduler.check_kv_balance()
    assert not engine.scheduler.prefill.waiting and not engine.scheduler.decode.running


def test_bad_server_args():
    from loom.config import ServerArgs

    with pytest.raises(ValueError, match="page_size"):
        ServerArgs(page_size=0)
    with pytest.raises(ValueError, match="dtype"):
        ServerArgs(dtype="float8")
    with pytest.raises(TypeError, match="not_a_flag"):
        ServerArgs.from_kwargs(not_a_flag=1)


def test_missing_model_says_how_to_install():
    from loom.model_loader.model_path import resolve_model_path

    with pytest.raises(FileNotFoundError, match="not found"):
        resolve_model_path("/no/such/model")
