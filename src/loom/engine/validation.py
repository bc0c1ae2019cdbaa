"""Checking a request on the front end before anything is submitted: its prompt and sampling
parameters, and the request options (logprobs, priority, cache salt)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from loom import plugins
from loom.sampling.limits import ParamError, check_context, check_number, show
from loom.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from loom.config import ServerArgs
    from loom.engine.tokenizer_manager import TokenizerManager


def prepare_request(
    prompt: str | None,
    input_ids: list[int] | None,
    sampling_params: dict[str, Any] | SamplingParams | None,
    *,
    vocab_size: int,
    context_len: int,
    tokenizer_manager: TokenizerManager | None,
    server_args: ServerArgs,
    check_constraint: Callable[[str, str], None],
) -> tuple[list[int], SamplingParams]:
    """A request's token ids and validated sampling parameters, or a ``ValueError`` (a
    ``ParamError`` naming the field) that says what is wrong: the parameters, the prompt
    (tokenised here), its length and the new tokens against the context, the logits
    processor and its parameters, the structured-output constraint (compiled now, cached)."""
    # the default max_new_tokens (not asked for) is capped to what fits the context
    explicit = isinstance(sampling_params, SamplingParams) or (
        isinstance(sampling_params, dict) and "max_new_tokens" in sampling_params
    )
    if isinstance(sampling_params, SamplingParams):
        params = dataclasses.replace(sampling_params)
    else:
        params = SamplingParams.from_dict(sampling_params)
    params.validate(vocab_size)
    if input_ids is None:
        if prompt is None:
            raise ValueError("either prompt (text) or input_ids is required")
        if not isinstance(prompt, str):
            raise ParamError("prompt", f"prompt must be a string, got {type(prompt).__name__}")
        if tokenizer_manager is None:
            raise ValueError(
                "text prompts need a tokenizer (started with --skip-tokenizer-init): pass input_ids"
            )
        input_ids = tokenizer_manager.encode(prompt)
    if not isinstance(input_ids, list) or not input_ids:
        raise ParamError("input_ids", "prompt is empty: at least one input token is required")
    vocab = vocab_size
    if any(type(t) is not int or not 0 <= t < vocab for t in input_ids):
        raise ParamError("input_ids", f"input_ids must be token ids in [0, {vocab})")
    if len(input_ids) >= context_len:
        raise ParamError(
            "input_ids" if prompt is None else "prompt",
            f"prompt is too long: {len(input_ids)} tokens, the context length "
            f"is {context_len} (the prompt must leave room for at least "
            "one new token)",
        )
    room = context_len - len(input_ids)
    if params.max_new_tokens > room:
        if explicit and not server_args.clamp_max_new_tokens:
            check_context(len(input_ids), params.max_new_tokens, context_len)
        params.max_new_tokens = room
        params.min_new_tokens = min(params.min_new_tokens, room)
    if params.custom_logit_processor is not None:
        from loom.sampling.logits_processor import is_serialized
        from loom.sampling.sampler import get_processor

        if is_serialized(params.custom_logit_processor) and not (
            server_args.enable_custom_logit_processor
        ):
            raise ValueError(
                "custom_logit_processor: serialized (dill) processors execute code sent by "
                "the client and are refused; use a named processor plug-in, or start the "
                "server with --enable-custom-logit-processor if every client is trusted"
            )
        try:
            proc = get_processor(params.custom_logit_processor)
        except plugins.RegistryError as e:
            raise ValueError(f"custom_logit_processor: {e}") from e
        proc.validate_params(params.custom_params)
    if params.stop and tokenizer_manager is None:
        raise ValueError("stop strings need a tokenizer; use stop_token_ids")
    if params.constraint is not None:
        check_constraint(*params.constraint)
    return list(input_ids), params


def logprob_options(ret: Any, top: Any, start: Any) -> tuple[bool, int, int]:
    if not isinstance(ret, bool):
        raise ParamError("return_logprob", f"return_logprob must be a boolean, got {show(ret)}")
    check_number("top_logprobs_num", top)
    check_number("logprob_start_len", start)
    if (top or start >= 0) and not ret:
        raise ParamError(
            "return_logprob", "top_logprobs_num / logprob_start_len need return_logprob=True"
        )
    return ret, top, start


def check_options(priority: Any, extra_key: Any) -> None:
    if priority is not None:
        check_number("priority", priority)
    if extra_key is not None and not isinstance(extra_key, str):
        raise ParamError(
            "extra_key", f"extra_key (cache_salt) must be a string, got {show(extra_key)}"
        )
