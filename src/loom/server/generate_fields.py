"""SGLang's ``/generate`` body (every field of its ``GenerateReqInput``), field by field: what
Loom does with each. Every field is accepted by name (an unknown one is a 400 that names it):

- ``USED``: honoured as SGLang honours it.
- ``NO_EFFECT``: accepted and ignored, because it does not change what is generated: metadata
  (labels, trace headers, ids for a router), or a hint to machinery Loom does not have and whose
  absence SGLang also tolerates (a KV-hint for a storage backend that reads none).
- ``REFUSED``: a feature Loom does not implement (images, hidden states, disaggregation, ...):
  a 400 that names the field and says why, unless the value asks for nothing (null, false, 0,
  an empty string, list or object; for a list, every entry).
"""

from __future__ import annotations

from typing import Any

USED, NO_EFFECT, REFUSED = "used", "no effect", "refused"

_TEXT_ONLY = "Loom serves text models"
_PD = "prefill-decode disaggregation is not supported"

# name -> (kind, description; for REFUSED, why)
GENERATE_FIELDS: dict[str, tuple[str, str]] = {
    "rid": (USED, "Request id; for a batch one per prompt, or a prefix (rid_0, rid_1, ...)."),
    "session_id": (NO_EFFECT, "A session's id for routing and cache affinity."),
    "text": (USED, "A prompt, or a list of prompts (a batch)."),
    "input_ids": (USED, "Token ids, or a list of token-id lists (a batch)."),
    "input_embeds": (REFUSED, "prompts as embeddings are not supported: give text or input_ids"),
    "image_data": (REFUSED, _TEXT_ONLY),
    "video_data": (REFUSED, _TEXT_ONLY),
    "audio_data": (REFUSED, _TEXT_ONLY),
    "mm_hashes": (REFUSED, _TEXT_ONLY),
    "mm_content_hashes": (REFUSED, _TEXT_ONLY),
    "use_audio_in_video": (REFUSED, _TEXT_ONLY),
    "video_config": (REFUSED, _TEXT_ONLY),
    "sampling_params": (USED, "SGLang's sampling parameters (one, or one per prompt)."),
    "watermark": (REFUSED, "watermarking is not supported"),
    "return_logprob": (USED, "Return the sampled tokens' logprobs (one, or one per prompt)."),
    "logprob_start_len": (USED, "Prompt logprobs from this position (-1: none)."),
    "top_logprobs_num": (USED, "The top logprobs per token (0-20)."),
    "token_ids_logprob": (
        USED,
        "Token ids whose logprobs every position reports (one list, or one per prompt).",
    ),
    "return_sampling_mask": (REFUSED, "sampling masks are not returned"),
    "sampling_logprobs_mode": (REFUSED, "sampling masks are not returned"),
    "return_text_in_logprobs": (USED, "Logprob entries carry their token's text (else null)."),
    "return_flat_raw_top_logprobs": (REFUSED, "flat logprob arrays are not returned"),
    "return_flat_raw_output_top_logprobs": (REFUSED, "flat logprob arrays are not returned"),
    "return_flat_raw_top_logprobs_b64": (REFUSED, "flat logprob arrays are not returned"),
    "stream": (USED, "Stream server-sent events."),
    "log_metrics": (NO_EFFECT, "Whether the request counts in metrics."),
    "return_hidden_states": (REFUSED, "hidden states are not returned"),
    "return_routed_experts": (REFUSED, "mixture-of-experts routing is not returned"),
    "routed_experts_start_len": (REFUSED, "mixture-of-experts routing is not returned"),
    "return_indexer_topk": (REFUSED, "sparse-attention indexer results are not returned"),
    "modalities": (REFUSED, _TEXT_ONLY),
    "session_params": (REFUSED, "sessions (/open_session) are not supported"),
    "lora_path": (USED, "A LoRA adapter by name (one, or one per prompt)."),
    "lora_id": (REFUSED, "an internal field of SGLang's: name the adapter with lora_path"),
    "custom_logit_processor": (
        USED,
        "A logits processor installed on the server, by name; or SGLang's serialised "
        "CustomLogitProcessor.to_str() (only with --enable-custom-logit-processor: it runs "
        "code sent by the client). One, or one per prompt.",
    ),
    "positional_embed_overrides": (REFUSED, "embedding overrides are not supported"),
    "bootstrap_host": (REFUSED, _PD),
    "bootstrap_port": (REFUSED, _PD),
    "bootstrap_room": (REFUSED, _PD),
    "bootstrap_pair_key": (REFUSED, _PD),
    "decode_tp_size": (REFUSED, _PD),
    "routed_dp_rank": (REFUSED, "Loom has one data-parallel rank: only 0"),
    "data_parallel_rank": (REFUSED, "Loom has one data-parallel rank: only 0"),
    "disagg_prefill_dp_rank": (REFUSED, _PD),
    "routing_key": (NO_EFFECT, "A key for SGLang's routing-key schedule policy."),
    "conversation_id": (NO_EFFECT, "Metadata for tracking requests."),
    "http_worker_ipc": (REFUSED, "an internal field of SGLang's"),
    "background": (REFUSED, "background responses are not supported"),
    "require_reasoning": (REFUSED, "hybrid reasoning control is not supported"),
    "max_thinking_tokens": (
        REFUSED,
        "a thinking budget is the thinking_budget logits processor, given the model's "
        'think-end ids (custom_logit_processor "thinking_budget")',
    ),
    "priority": (USED, "Scheduling priority (--schedule-policy priority)."),
    "extra_key": (USED, "A prefix-cache namespace: different keys share no cached KV."),
    "no_logs": (NO_EFFECT, "Loom logs no request contents."),
    "custom_labels": (NO_EFFECT, "Metric labels (Loom's metrics have no per-request labels)."),
    "return_bytes": (REFUSED, "an internal field of SGLang's (image generation)"),
    "return_entropy": (REFUSED, "entropies are not returned"),
    "return_prompt_token_ids": (USED, "Add the prompt's ids to the result (prompt_token_ids)."),
    "external_trace_header": (NO_EFFECT, "Trace context (Loom does not trace)."),
    "received_time": (NO_EFFECT, "A router's arrival timestamp for the request."),
    "need_wait_for_mm_inputs": (REFUSED, _TEXT_ONLY),
    "num_items_assigned": (REFUSED, _TEXT_ONLY),
    "encoder_urls": (REFUSED, _TEXT_ONLY),
    "max_dynamic_patch": (REFUSED, _TEXT_ONLY),
    "min_dynamic_patch": (REFUSED, _TEXT_ONLY),
    "image_max_dynamic_patch": (REFUSED, _TEXT_ONLY),
    "video_max_dynamic_patch": (REFUSED, _TEXT_ONLY),
    "images_config": (REFUSED, _TEXT_ONLY),
    "mm_processor_kwargs": (REFUSED, _TEXT_ONLY),
    "multi_item_delimiter_indices": (REFUSED, "multi-item scoring is not supported"),
    "token_indices_to_pool": (REFUSED, "pooling readouts are not supported"),
    "cache_salt": (USED, "A prefix-cache namespace, as extra_key (both: both apply)."),
    "kv_hints": (NO_EFFECT, "Hints for HiCache storage backends (Loom's read none)."),
}


def describe(name: str) -> str:
    """The field's line in the OpenAPI schema."""
    kind, doc = GENERATE_FIELDS[name]
    if kind == REFUSED:
        return f"Refused unless null, false or empty: {doc}."
    return f"Accepted, no effect: {doc}" if kind == NO_EFFECT else doc


def asks_for_nothing(value: Any) -> bool:
    """null, false, 0, an empty string, list or object, or a list of those."""
    if isinstance(value, list):
        return all(asks_for_nothing(v) for v in value)
    return (
        value is None or value is False or value in ("", {}) or (type(value) is int and value == 0)
    )


def refused_field(body: dict[str, Any]) -> tuple[str, str] | None:
    """(name, why) of the first field of ``body`` that asks for what Loom does not do."""
    for name, value in body.items():
        kind, why = GENERATE_FIELDS.get(name, (USED, ""))
        if kind == REFUSED and not asks_for_nothing(value):
            return name, why
    return None
