"""The request bodies of the generation routes as pydantic models: the fields each route takes,
declared once (an unknown field is a 400 that names it) and published in the OpenAPI schema.

Each value is kept as the JSON the client sent: its type and bounds are checked afterwards, by
``protocol.py`` and ``sampling/limits.py``, so that every error names the field as the request
spelled it and states the bound. (Pydantic's own coercion would take ``true`` for 1 and
``"1"`` for 1, and its messages name neither the bound nor OpenAI's spelling.)
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from loom.sampling.limits import show
from loom.server.errors import bad
from loom.server.generate_fields import GENERATE_FIELDS, describe


def _field(doc: str) -> Any:
    return Field(default=None, description=doc)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class _OpenAIBody(_Body):
    model: Any = _field("The served model, or one of its LoRA adapters (NAME or BASE:NAME).")
    n: Any = _field("Choices per prompt (1-64).")
    stream: Any = _field("Stream server-sent events.")
    stream_options: Any = _field('{"include_usage": true}: a final chunk with usage.')
    max_tokens: Any = _field("New tokens at most (default: what the context leaves).")
    max_completion_tokens: Any = _field("max_tokens' newer name; wins when both are given.")
    temperature: Any = _field("Sampling temperature; 0 is greedy.")
    top_p: Any = _field("Nucleus sampling.")
    top_k: Any = _field("Top-k sampling (-1: off).")
    min_p: Any = _field("Min-p sampling.")
    seed: Any = _field("Seed: the same tokens alone or in any batch.")
    stop: Any = _field("Stop strings (a string or a list).")
    stop_token_ids: Any = _field("Token ids that stop generation.")
    stop_regex: Any = _field("Regular expressions that stop generation (SGLang's extension).")
    stream_interval: Any = _field("Stream every N tokens (SGLang's extension).")
    ignore_eos: Any = _field("Do not stop at EOS.")
    skip_special_tokens: Any = _field("Leave special tokens out of the text.")
    no_stop_trim: Any = _field("Keep the matched stop string in the text.")
    frequency_penalty: Any = _field("OpenAI's frequency penalty.")
    presence_penalty: Any = _field("OpenAI's presence penalty.")
    repetition_penalty: Any = _field("CTRL's repetition penalty (1: off).")
    min_tokens: Any = _field("EOS and stop tokens are blocked before this many.")
    logit_bias: Any = _field("Token id -> bias added to its logit.")
    custom_logit_processor: Any = _field("A logits processor installed on the server, by name.")
    custom_params: Any = _field("The processor's parameters.")
    response_format: Any = _field("text, json_object, json_schema or structural_tag.")
    regex: Any = _field("Constrain the output to a regular expression.")
    ebnf: Any = _field("Constrain the output to an EBNF grammar.")
    logprobs: Any = _field("Chat: return logprobs (a boolean); completions: top-N logprobs.")
    top_logprobs: Any = _field("Chat: the top logprobs per token (0-20).")
    priority: Any = _field("Scheduling priority (--schedule-policy priority).")
    cache_salt: Any = _field("A prefix-cache namespace: different salts share no KV.")
    lora_path: Any = _field("A LoRA adapter by name.")
    user: Any = _field("Metadata; does not change generation.")
    metadata: Any = _field("Metadata; does not change generation.")
    store: Any = _field("Metadata; does not change generation.")
    service_tier: Any = _field("Metadata; does not change generation.")
    rid: Any = _field("Metadata; does not change generation.")
    suffix: Any = _field("Not supported yet: refused unless empty.")


class ChatCompletionRequest(_OpenAIBody):
    messages: Any = _field(
        "The conversation: role and content (text or text parts); assistant turns may carry "
        "tool_calls, and tool turns the tool_call_id they answer."
    )
    tools: Any = _field('Functions the model may call: [{"type": "function", "function": ...}].')
    tool_choice: Any = _field(
        'none, auto (default with tools), required, or {"type": "function", "function": '
        '{"name": ...}}; required and a named function are enforced by the grammar backend.'
    )
    parallel_tool_calls: Any = _field("Several calls in one answer (default true).")
    chat_template_kwargs: Any = _field(
        'Extra variables for the chat template, e.g. {"enable_thinking": false}.'
    )
    separate_reasoning: Any = _field(
        "With --reasoning-parser: the thoughts in reasoning_content (default true)."
    )


class CompletionRequest(_OpenAIBody):
    prompt: Any = _field("A string, a list of them, token ids, or a list of token-id lists.")
    echo: Any = _field("Return the prompt before the completion.")
    best_of: Any = _field("Samples per prompt (>= n); the n best by mean logprob are returned.")


# SGLang's native /generate takes every field of its GenerateReqInput; what Loom does with each
# is ``generate_fields.GENERATE_FIELDS``.
GenerateBody = create_model(
    "GenerateBody",
    __base__=_Body,
    **{name: (Any, _field(describe(name))) for name in GENERATE_FIELDS},
)


def fields_of(schema: type[_Body], body: Any) -> dict[str, Any]:
    """The fields ``body`` gives (explicit nulls included), or a 400 naming what is wrong: a
    body that is not an object, or its first field ``schema`` does not declare."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    try:
        schema.model_validate(body)  # (values are JSON as sent: the body itself is the result)
    except ValidationError as e:
        err = e.errors()[0]
        key = str(err["loc"][0]) if err["loc"] else None
        if err["type"] == "extra_forbidden":
            raise bad(f"unknown field {show(key)}", key[:64]) from None
        raise bad(f"{key}: {err['msg']}", key) from None
    return body


def openapi(schema: type[_Body]) -> dict[str, Any]:
    """A route's ``openapi_extra``: its body's JSON schema (the route reads the body itself,
    bounded and checked, before validating it)."""
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": schema.model_json_schema()}},
        }
    }
