"""The front end's section of the server arguments: the HTTP server, logging and the OpenAI
API's chat features."""

from __future__ import annotations

from dataclasses import dataclass, field

from loom.config.sections import _arg, _check_choices, _positive


@dataclass(frozen=True)
class HTTPArgs:
    """The HTTP server (``loom serve``) and logging."""

    host: str = field(default="127.0.0.1", metadata=_arg("Address the HTTP server listens on."))
    port: int = field(default=30000, metadata=_arg("Port of the HTTP server."))
    api_key: str | None = field(
        default=None,
        metadata=_arg("Require `Authorization: Bearer <key>` on every route but /health."),
    )
    served_model_name: str | None = field(
        default=None, metadata=_arg("Model name clients use in the OpenAI API (default: --model).")
    )
    disable_metrics: bool = field(
        default=False, metadata=_arg("Turn off the Prometheus /metrics route.")
    )
    tool_call_parser: str = field(
        default="auto",
        metadata=_arg(
            "How chat completions find tool calls in a model's output (tool_choice auto): a "
            "format the model was trained on; auto: the one its chat template renders.",
            family="tool_call_parser",
            extra_choices=("auto",),
        ),
    )
    incremental_streaming_output: bool = field(
        default=False,
        metadata=_arg(
            "Streamed /generate chunks carry only the new text and output_ids; without it each "
            "chunk carries everything so far (SGLang's default). OpenAI streams are always "
            "deltas."
        ),
    )
    max_request_body_mb: float = field(
        default=64.0,
        metadata=_arg("Largest request body accepted, in MiB (a larger one is answered 413)."),
    )
    max_queued_requests: int | None = field(
        default=None,
        metadata=_arg(
            "Reject requests with 503 while this many are waiting to start (default: no limit)."
        ),
    )
    tokenizer_worker_num: int = field(
        default=1,
        metadata=_arg(
            "Front-end processes of `loom serve` (HTTP, tokenizing, detokenizing, streaming) "
            "sharing its port; the scheduler sends each request's outputs to the process that "
            "took it. With more than one, --max-queued-requests is shared out among them and "
            "an adapter is unloaded only while no front end's request uses it."
        ),
    )
    log_level: str = field(
        default="warning",
        metadata=_arg("Logging level.", choices=("debug", "info", "warning", "error")),
    )

    def __post_init__(self) -> None:
        _check_choices(self)
        _positive(self, "max_queued_requests", "tokenizer_worker_num")
        limit, workers = self.max_queued_requests, self.tokenizer_worker_num
        if limit is not None and limit < workers:
            raise ValueError(
                f"max_queued_requests ({limit}) is shared out among the front-end processes: "
                f"it must be >= tokenizer_worker_num ({workers})"
            )
        if self.max_request_body_mb <= 0:
            raise ValueError(f"max_request_body_mb must be > 0, got {self.max_request_body_mb}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
