"""A request as the scheduler sees it: its parameters and the state of its KV, sampling and
outputs (``Req``), built from the front end's ``GenerateRequest``."""

from __future__ import annotations

import time
from typing import Any

from loom.sampling.sampling_params import SamplingParams
from loom.scheduler.messages import GenerateRequest, ReqOutput

__all__ = ["Req", "ReqOutput"]


class Req:
    def __init__(
        self,
        rid: str,
        input_ids: list[int],
        sampling_params: SamplingParams,
        priority: int = 0,
        extra_key: str | None = None,
        lora_name: str | None = None,
        lora_id: str | None = None,
    ) -> None:
        self.rid = rid
        # LoRA adapter (its reference id, and its name for messages; None: the base model) and
        # its device slot while running (-1: none held). Its KV is the adapter's own: the
        # scheduler puts the adapter's digest into the prefix-cache namespace
        # (``LoRAManager.cache_namespace``).
        self.lora_id = lora_id
        self.lora_name = lora_name
        self.lora_slot = -1
        # Scheduling priority (``--schedule-policy priority``; higher runs first) and the prefix
        # cache's eviction priority (``--radix-eviction-policy priority``; lower goes first).
        self.priority = priority
        # Prefix-cache namespace (``cache_salt``, and the LoRA adapter): requests with different
        # extra keys never share cached KV.
        self.extra_key = extra_key
        self.origin_input_ids = list(input_ids)
        self.sampling_params = sampling_params
        self.output_ids: list[int] = []
        self.finished_reason: dict[str, Any] | None = None
        self.error: str | None = None
        # KV state: positions [0, kv_len) are cached in pages ``kv_pages`` (row req_pool_idx).
        self.req_pool_idx: int | None = None
        self.kv_pages: list[int] = []
        # The first ``num_shared_pages`` of kv_pages belong to the radix cache (a matched prefix,
        # locked through ``prefix_node`` while the request runs); the rest are the request's own.
        self.num_shared_pages = 0
        self.prefix_node = None
        self.kv_len = 0
        self.cached_tokens = 0  # prompt tokens served from a prefix cache
        self.num_retractions = 0
        self.arrival_time = time.monotonic()
        # Structured output: the compile future while queued, then the matcher.
        self.grammar_future = None
        self.grammar_deadline = 0.0
        self.grammar = None
        self.closed_at: int | None = None  # output length when closing within budget began
        self.close_next = 0  # output length at which closing walks the grammar again
        # Penalties: this request's row of the scheduler's PenaltyState (counts on the device).
        self.penalty_row: int | None = None
        # An SGLang processor's custom_params with "__req__", kept for the request's life as
        # SGLang keeps it (``sampling.sglang_processor``)
        self.processor_params: dict[str, Any] | None = None
        # Logprobs (``return_logprob``): entries not yet sent to the front end.
        self.return_logprob = False
        self.top_logprobs_num = 0
        self.logprob_start_len = -1
        self.pending_logprobs: list[tuple[float, int]] = []
        self.pending_top_logprobs: list[list[tuple[float, int]]] = []
        self.pending_input_logprobs: list | None = None
        self.input_logprob_acc: list = []
        # with top_logprobs_num: each prompt token's top entries, row for row with the above
        self.pending_input_top_logprobs: list | None = None
        self.input_top_acc: list = []
        # with token_ids_logprob: the logprobs of those ids at each position, likewise
        self.token_ids_logprob: tuple[int, ...] | None = None
        self.pending_token_ids_logprobs: list[list[tuple[float, int]]] = []
        self.pending_input_token_ids_logprobs: list | None = None
        self.input_token_ids_acc: list = []

    @classmethod
    def from_message(cls, m: GenerateRequest) -> Req:
        req = cls(
            m.rid, m.input_ids, m.sampling_params, m.priority, m.extra_key, m.lora_name, m.lora_id
        )
        req.return_logprob, req.top_logprobs_num = m.return_logprob, m.top_logprobs_num
        req.logprob_start_len, req.token_ids_logprob = m.logprob_start_len, m.token_ids_logprob
        return req

    @property
    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0 and not self.output_ids

    @property
    def prompt_hash(self) -> int:
        h = getattr(self, "_prompt_hash", None)
        if h is None:
            h = self._prompt_hash = hash((self.extra_key, tuple(self.origin_input_ids)))
        return h

    @property
    def fill_ids(self) -> list[int]:
        """Tokens whose KV the request needs: the prompt plus everything generated so far."""
        return self.origin_input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def is_finished(self) -> bool:
        return self.finished_reason is not None

    def __repr__(self) -> str:
        return (
            f"Req(rid={self.rid!r}, prompt={len(self.origin_input_ids)}, "
            f"out={len(self.output_ids)}, kv={self.kv_len})"
        )
