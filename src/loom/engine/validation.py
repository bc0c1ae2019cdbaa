"""Checking a request on the front end before anything is submitted: its prompt and sampling
parameters, and the request options (logprobs, priority, cache salt)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from loom import plugins
from loom.sampling.limits import INT64_MAX, ParamError, check_context, check_number, show
from loom.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from loom.config import SamplingArgs
    from loom.engine.tokenizer_manager import TokenizerManager


def prepare_request(
    prompt: str | None,
    input_ids: list[int] | None,
    sampling_params: dict[str, Any] | SamplingParams | None,
    *,
    vocab_size: int,
    context_len: int,
    tokenizer_manager: TokenizerManager | None,
    sampling_args: SamplingArgs,
    check_constraint: Callable[[str, str], None],
) -> tuple[list[int], SamplingParams]:
    """A request's token ids and validated sampling parameters, or a ``ValueError`` (a
    ``ParamError`` naming the field) that says what is wrong: the parameters, the prompt
    (tokenised here), its length and the new tokens against the context, the logits
    processor and its parameters, the structured-output constraint (compiled now, cached)."""
    # the default max_new_tokens (not asked for) is capped to what fits the context; so is
    # null, which asks for what the context leaves (SGLang)
    explicit = isinstance(sampling_params, SamplingParams) or (
        isinstance(sampling_params, dict) and sampling_params.get("max_new_tokens") is not None
    )
    if (
        isinstance(sampling_params, dict)
        and "max_new_tokens" in sampling_params
        and sampling_params["max_new_tokens"] is None
    ):
        sampling_params = {**sampling_params, "max_new_tokens": INT64_MAX}
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
        if explicit and not sampling_args.clamp_max_new_tokens:
            check_context(len(input_ids), params.max_new_tokens, context_len)
        params.max_new_tokens = room
        params.min_new_tokens = min(params.min_new_tokens, room)
    if params.custom_logit_processor is not None:
        check_processor(params, sampling_args.enable_custom_logit_processor)
    if params.stop and tokenizer_manager is None:
        raise ValueError("stop strings need a tokenizer; use stop_token_ids")
    if params.stop_regex and tokenizer_manager is None:
        raise ParamError("stop_regex", "stop_regex needs a tokenizer; use stop_token_ids")
    if params.constraint is not None:
        check_constraint(*params.constraint)
    return list(input_ids), params


def check_processor(params: SamplingParams, enable_serialized: bool) -> None:
    """The request's ``custom_logit_processor``: a named plug-in (its parameters checked by
    it), or, only where the server allows it, SGLang's serialised processor (rebuilt now, once
    per payload, so that a payload that cannot be used is refused before anything runs)."""
    from loom.sampling.sampler import get_processor
    from loom.sampling.sglang_processor import is_serialized

    serialized = is_serialized(params.custom_logit_processor)
    if serialized and not enable_serialized:
        raise ParamError(
            "custom_logit_processor",
            "custom_logit_processor: this server does not run client-sent (serialised) "
            "processors, which execute code sent by the client; use a processor installed on "
            "the server by name, or start the server with --enable-custom-logit-processor "
            "if every client is trusted",
        )
    try:
        proc = get_processor(params.custom_logit_processor)
    except plugins.RegistryError as e:
        raise ParamError("custom_logit_processor", f"custom_logit_processor: {e}") from e
    except ValueError as e:
        raise ParamError("custom_logit_processor", str(e)) from e
    if not serialized:
        proc.validate_params(params.custom_params or {})


# token_ids_logprob: at most this many ids (each is one more logprob per position)
MAX_TOKEN_IDS_LOGPROB = 1024


def logprob_options(
    ret: Any, top: Any, start: Any, ids: Any = None, vocab_size: int | None = None
) -> tuple[bool, int, int, tuple[int, ...] | None]:
    """One request's logprob options, checked: ``return_logprob``, ``top_logprobs_num``,
    ``logprob_start_len`` and ``token_ids_logprob`` (the ids whose logprobs every position
    reports; null or empty: none)."""
    if not isinstance(ret, bool):
        raise ParamError("return_logprob", f"return_logprob must be a boolean, got {show(ret)}")
    check_number("top_logprobs_num", top)
    check_number("logprob_start_len", start)
    ids = token_ids_option(ids, vocab_size)
    if (top or start >= 0 or ids) and not ret:
        raise ParamError(
            "return_logprob",
            "top_logprobs_num / logprob_start_len / token_ids_logprob need return_logprob=True",
        )
    return ret, top, start, ids


def token_ids_option(ids: Any, vocab_size: int | None) -> tuple[int, ...] | None:
    """``token_ids_logprob`` for one request: a token id or a list of them (SGLang's forms),
    each in the vocabulary; None when it asks for none."""
    if ids is None or ids == []:
        return None
    if not isinstance(ids, list):
        ids = [ids]
    if len(ids) > MAX_TOKEN_IDS_LOGPROB:
        raise ParamError(
            "token_ids_logprob",
            f"token_ids_logprob has {len(ids)} ids; at most {MAX_TOKEN_IDS_LOGPROB}",
        )
    for i in ids:
        check_number("token_id", i, "a token_ids_logprob entry", vocab_size, "token_ids_logprob")
    return tuple(ids)


def check_options(priority: Any, extra_key: Any) -> None:
    if priority is not None:
        check_number("priority", priority)
    if extra_key is not None and not isinstance(extra_key, str):
        raise ParamError(
            "extra_key", f"extra_key (cache_salt) must be a string, got {show(extra_key)}"
        )


def check_lora(name: Any, lora_names: set[str] | None) -> None:
    """A request's ``lora_path``: None (the base model) or a loaded adapter's name."""
    if name is None:
        return
    if not isinstance(name, str):
        raise ValueError(f"lora_path must be an adapter name (a string), got {name!r}")
    if lora_names is None:
        raise ValueError(
            f"LoRA adapter {name!r} requested, but this server has no adapters "
            "(start it with --lora-paths NAME=PATH)"
        )
    if name not in lora_names:
        raise ValueError(f"unknown LoRA adapter {name!r}; loaded: {', '.join(sorted(lora_names))}")


class ConstraintChecker:
    """Compiles a request's structured-output constraint on the front end before it is
    submitted (cached by the grammar manager), so that a bad one is refused at once; the
    scheduler, maybe in another process, compiles its own."""

    def __init__(self, grammar_args, tokenizer, vocab_size: int, eos_token_ids) -> None:
        self.grammar_args = grammar_args
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos = set(eos_token_ids)
        self._mgr = None

    def _manager(self):
        if self._mgr is None:
            from loom.constrained.manager import GrammarManager, build_grammar_backend

            args, tok, vocab, eos = self.grammar_args, self.tokenizer, self.vocab_size, self.eos
            self._mgr = GrammarManager(lambda: build_grammar_backend(args, tok, vocab, eos))
        return self._mgr

    def check(self, kind: str, text: str) -> None:
        from concurrent.futures import TimeoutError as FutureTimeout

        if self.tokenizer is None:
            raise ValueError(f"{kind} needs a tokenizer (started with --skip-tokenizer-init)")
        timeout = self.grammar_args.grammar_compile_timeout
        try:
            self._manager().compile(kind, text, timeout=timeout)
        except FutureTimeout as e:
            raise ValueError(f"{kind} took longer than {timeout} s to compile") from e

    def close(self) -> None:
        if self._mgr is not None:
            self._mgr.close()
