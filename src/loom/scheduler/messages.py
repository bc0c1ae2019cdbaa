"""What the front end and the scheduler send each other: small immutable types, pickled as they
are over ZMQ when the scheduler runs in a process of its own.

In: ``AddRequests`` (a call's requests travel together, so one ``generate`` call's requests are
scheduled together whatever the threads' timing), ``Abort``, ``FlushCache``, ``LoadLoRA`` /
``UnloadLoRA`` and ``UpdateWeights`` (answered by a ``ReqOutput`` for their ``id`` whose
``error`` says why they failed) and ``Shutdown``. Out: ``SchedulerBatchOut``, a step's ``ReqOutput``s plus load figures.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from loom.sampling.sampling_params import SamplingParams


@dataclass(frozen=True)
class GenerateRequest:
    """One request as the front end submits it (validated there)."""

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    priority: int = 0
    extra_key: str | None = None  # a prefix-cache namespace (cache_salt; the LoRA adapter)
    lora_name: str | None = None
    lora_id: str | None = None  # the adapter's reference (``lora.registry.LoRARef``)
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    token_ids_logprob: tuple[int, ...] | None = None  # ids whose logprobs each position reports


@dataclass(frozen=True)
class AddRequests:
    requests: list[GenerateRequest]


@dataclass(frozen=True)
class Abort:
    rid: str


@dataclass(frozen=True)
class FlushCache:
    pass


@dataclass(frozen=True)
class LoadLoRA:
    """Load an adapter while serving; answered once it is read and registered (or refused)."""

    id: str
    ref: Any  # ``lora.registry.LoRARef``


@dataclass(frozen=True)
class UnloadLoRA:
    id: str
    lora_id: str
    name: str


@dataclass(frozen=True)
class UpdateWeights:
    """Swap the model's weights for those at ``model_path`` (SGLang's update_weights_from_disk);
    the running requests are aborted with ``abort_all_requests``, else paused (retracted, to
    continue on the new weights). The reply's ``finished_reason`` carries
    ``num_paused_requests``."""

    id: str
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False


@dataclass(frozen=True)
class Shutdown:
    pass


Message = AddRequests | Abort | FlushCache | LoadLoRA | UnloadLoRA | UpdateWeights | Shutdown


@dataclass
class ReqOutput:
    """New tokens of one request after one step (``finished_reason`` set on its last output)."""

    rid: str
    new_token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    finished_reason: dict[str, Any] | None = None
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class SchedulerBatchOut:
    outputs: list[ReqOutput]
    stats: dict[str, Any] = field(default_factory=dict)
    # time.monotonic() when the scheduler emitted it (one clock for every process of this
    # machine): the front end measures its hand-over delay from here
    sent_at: float = field(default_factory=time.monotonic)

    def __reduce__(self):
        # Pickled as one tuple per output: pickle's default form of a dataclass instance
        # (its class, then a state dict) costs 5x as much on each end, 1 us an output, and
        # a step carries one output per running request (measured on the CPU machine). The
        # row is ReqOutput's fields in order (attribute reads: 2x faster than attrgetter).
        rows = [
            (
                o.rid,
                o.new_token_ids,
                o.prompt_tokens,
                o.completion_tokens,
                o.cached_tokens,
                o.finished_reason,
                o.error,
                o.extra,
            )
            for o in self.outputs
        ]
        return (_batch_from_rows, (rows, self.stats, self.sent_at))


def _batch_from_rows(rows: list[tuple], stats: dict[str, Any], sent_at: float) -> SchedulerBatchOut:
    return SchedulerBatchOut([ReqOutput(*row) for row in rows], stats, sent_at)
