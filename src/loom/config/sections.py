"""The sections of the server arguments: one frozen dataclass per component, whose fields are
the flags (``metadata``: help, the plug-in family or choices a value is checked against)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

DEFAULT_MODEL = "smollm2-135m-instruct"


def _arg(
    help: str,
    *,
    family: str | None = None,
    choices: tuple[str, ...] | None = None,
    aliases: tuple[str, ...] = (),
    extra_choices: tuple[str, ...] = (),
) -> dict[str, Any]:
    return {
        "help": help,
        "family": family,
        "choices": choices,
        "aliases": aliases,
        "extra_choices": extra_choices,
    }


def _check_choices(section) -> None:
    for f in dataclasses.fields(section):
        choices = f.metadata.get("choices")
        value = getattr(section, f.name)
        if choices and value is not None and value not in choices:
            raise ValueError(f"{f.name} must be one of {', '.join(choices)}, got {value!r}")


def _positive(section, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


@dataclass(frozen=True)
class ModelArgs:
    """The model, its weights and tokenizer, and where it runs."""

    model: str = field(
        default=DEFAULT_MODEL,
        metadata=_arg(
            "Model: a name from an installed model package (default smollm2-135m-instruct), an HF "
            "directory, a .gguf file, or a config.json for --load-format dummy.",
            aliases=("--model-path",),
        ),
    )
    tokenizer_path: str | None = field(
        default=None, metadata=_arg("Tokenizer directory, if it differs from the model's.")
    )
    chat_template: str | None = field(
        default=None,
        metadata=_arg(
            "A Jinja chat template replacing the tokenizer's: a file's path, or the template "
            "itself."
        ),
    )
    load_format: str = field(
        default="auto", metadata=_arg("How to load weights.", family="model_loader")
    )
    quantization: str | None = field(
        default=None,
        metadata=_arg(
            "How linear layers store their weights: fp8 (E4M3 with per-channel scales, "
            "quantized at load; FP8 matmuls on Ada / Hopper GPUs), gguf (a GGUF file's blocks "
            "kept: Q4_0 / Q4_1 as int4 on the CPU, every block format as the file's bytes for "
            "Triton kernels on CUDA), bitsandbytes (NF4 / FP4 4-bit or "
            "LLM.int8() 8-bit on the bitsandbytes package's kernels: a bitsandbytes checkpoint "
            "read as stored, a dense one quantized to NF4 at load); default: dense in --dtype.",
            family="quantization",
        ),
    )
    model_impl: str = field(
        default="auto",
        metadata=_arg(
            "Which code runs the model: loom (Loom's own implementation of the architecture; "
            "refuses one Loom does not implement), transformers (transformers' modeling code "
            "with Loom's paged attention plugged in; one device, no tensor parallelism), auto "
            "(Loom's when it implements the architecture, else transformers').",
            choices=("auto", "loom", "transformers"),
        ),
    )
    skip_tokenizer_init: bool = field(
        default=False,
        metadata=_arg("Load no tokenizer: requests must pass input_ids and get output_ids only."),
    )
    dtype: str = field(
        default="auto",
        metadata=_arg(
            "Weight and activation dtype (auto: bfloat16 on CUDA, float32 on CPU).",
            choices=("auto", "float32", "bfloat16", "float16"),
        ),
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata=_arg(
            "KV cache dtype (auto: the model's). fp8_e4m3 / fp8_e5m2 halve the cache's memory "
            "and the bytes decode attention reads, at some accuracy (values are clamped to the "
            "format's range; no scales); the torch_native, flash_attention and triton backends "
            "read them.",
            choices=("auto", "float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2"),
        ),
    )
    device: str = field(
        default="auto",
        metadata=_arg(
            "Device to run on (auto: cuda if available).", choices=("auto", "cpu", "cuda")
        ),
    )
    context_length: int | None = field(
        default=None,
        metadata=_arg(
            "The longest sequence served (default: the model's, max_position_embeddings with "
            "its rope scaling); at most the model's."
        ),
    )
    random_seed: int = field(
        default=0,
        metadata=_arg("Seed for weights of --load-format dummy and for unseeded sampling."),
    )

    def __post_init__(self) -> None:
        _check_choices(self)


@dataclass(frozen=True)
class CacheArgs:
    """The KV pool and the prefix cache (radix tree, hierarchical tiers)."""

    page_size: int = field(default=1, metadata=_arg("Tokens per KV page."))
    max_total_tokens: int | None = field(
        default=None, metadata=_arg("KV pool size in tokens (default: from free memory).")
    )
    mem_fraction_static: float | None = field(
        default=None,
        metadata=_arg(
            "Fraction of memory for weights + KV pool (default 0.85 on CUDA, 0.25 of free RAM on CPU)."
        ),
    )
    disable_radix_cache: bool = field(
        default=False, metadata=_arg("Do not share KV between requests with a common prefix.")
    )
    radix_eviction_policy: str = field(
        default="lru", metadata=_arg("Radix-cache eviction policy.", family="radix_eviction_policy")
    )
    slru_protected_threshold: int = field(
        default=2,
        metadata=_arg(
            "slru eviction: hits after which a cached prefix moves to the protected segment."
        ),
    )
    enable_hierarchical_cache: bool = field(
        default=False,
        metadata=_arg(
            "Keep prefixes evicted from the device pool in host memory (and, with a storage "
            "backend, in a third tier) and load them back on a hit."
        ),
    )
    hicache_ratio: float = field(
        default=2.0,
        metadata=_arg(
            "Host KV tier size as a multiple of the device pool's (unless --hicache-size)."
        ),
    )
    hicache_size: float = field(
        default=0.0, metadata=_arg("Host KV tier size in GB (0: use --hicache-ratio).")
    )
    hicache_write_policy: str = field(
        default="write_through",
        metadata=_arg(
            "When device KV is copied to host: write_through (on insert), "
            "write_through_selective (once a prefix is hit twice), write_back (on eviction).",
            choices=("write_through", "write_through_selective", "write_back"),
        ),
    )
    hicache_storage_backend: str | None = field(
        default=None,
        metadata=_arg(
            "Third tier under the host cache (needs --enable-hierarchical-cache).",
            family="hicache_storage",
        ),
    )
    hicache_storage_backend_extra_config: str | None = field(
        default=None,
        metadata=_arg('The storage backend\'s options as JSON, e.g. \'{"path": "/data/kv"}\'.'),
    )

    def __post_init__(self) -> None:
        _positive(self, "page_size", "max_total_tokens")
        _check_choices(self)
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError(
                f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}"
            )
        if self.hicache_ratio <= 0 or self.hicache_size < 0:
            raise ValueError("hicache_ratio must be > 0 and hicache_size >= 0")
        if self.hicache_storage_backend and not self.enable_hierarchical_cache:
            raise ValueError("--hicache-storage-backend needs --enable-hierarchical-cache")
        if self.enable_hierarchical_cache and self.disable_radix_cache:
            raise ValueError("--enable-hierarchical-cache needs the radix cache")
        if self.hicache_storage_backend_extra_config is not None:
            try:
                extra = json.loads(self.hicache_storage_backend_extra_config)
            except json.JSONDecodeError as e:
                raise ValueError(f"hicache_storage_backend_extra_config is not JSON: {e}") from e
            if not isinstance(extra, dict):
                raise ValueError("hicache_storage_backend_extra_config must be a JSON object")


@dataclass(frozen=True)
class SchedulerArgs:
    """Batching: admission, chunked prefill, overlap."""

    max_running_requests: int | None = field(
        default=None,
        metadata=_arg(
            "Maximum requests decoded together (default: from the KV pool size, at most 1024 on CUDA, 512 on CPU)."
        ),
    )
    chunked_prefill_size: int | None = field(
        default=None,
        metadata=_arg(
            "Maximum prompt tokens in one prefill step, over all its requests (as SGLang; default "
            "8192 on CUDA, 1024 on CPU); longer prompts are prefilled in chunks; -1 disables "
            "chunking."
        ),
    )
    max_prefill_tokens: int = field(
        default=16384, metadata=_arg("Maximum prompt tokens in one prefill batch.")
    )
    schedule_policy: str = field(
        default="fcfs", metadata=_arg("Order of the waiting queue.", family="schedule_policy")
    )
    schedule_conservativeness: float = field(
        default=1.0,
        metadata=_arg(
            "How much decode room to reserve when admitting (0 admits greedily, retracting later)."
        ),
    )
    enable_mixed_chunk: bool = field(
        default=False,
        metadata=_arg(
            "Decode the running requests inside prefill batches (flatter inter-token latency "
            "while long prompts prefill)."
        ),
    )
    disable_overlap_schedule: bool = field(
        default=False,
        metadata=_arg("Do not prepare the next decode step while the GPU runs the current one."),
    )

    def __post_init__(self) -> None:
        _positive(self, "max_running_requests")
        if self.schedule_conservativeness < 0:
            raise ValueError("schedule_conservativeness must be >= 0")


@dataclass(frozen=True)
class SamplingArgs:
    """What requests may ask of sampling."""

    clamp_max_new_tokens: bool = field(
        default=False,
        metadata=_arg(
            "Cap a request's max_new_tokens (OpenAI: max_tokens) at what the context leaves "
            "after its prompt, instead of refusing the request with a 400 that says both numbers."
        ),
    )
    enable_custom_logit_processor: bool = field(
        default=False,
        metadata=_arg(
            "Accept SGLang's dill-serialised custom logit processors (runs client-sent code: "
            "only for trusted clients)."
        ),
    )

    def __post_init__(self) -> None:
        _check_choices(self)


@dataclass(frozen=True)
class GrammarArgs:
    """Structured output."""

    grammar_backend: str = field(
        default="xgrammar",
        metadata=_arg("Structured-output backend (none: off).", family="grammar_backend"),
    )
    reasoner_grammar_backend: str = field(
        default="xgrammar",
        metadata=_arg(
            "The backend that --grammar-backend reasoner wraps.",
            choices=("xgrammar", "llguidance"),
        ),
    )
    reasoning_parser: str | None = field(
        default=None,
        metadata=_arg(
            "Reasoning model preset (its think markers): chat answers carry the thoughts in "
            "reasoning_content, and structured output applies after them (the grammar "
            "backend is wrapped in the reasoner).",
            choices=("deepseek-r1", "qwen3", "glm45", "kimi"),
        ),
    )
    think_end_token: str | None = field(
        default=None,
        metadata=_arg("The string that ends thinking (overrides --reasoning-parser's)."),
    )
    think_budget: int | None = field(
        default=None,
        metadata=_arg("reasoner: force the think-end token after this many thinking tokens."),
    )
    grammar_compile_timeout: float = field(
        default=60.0,
        metadata=_arg("Seconds a constraint may take to compile before its request fails."),
    )
    structured_output_close_within_budget: str = field(
        default="json_schema",
        metadata=_arg(
            "Which constrained answers are steered onto a short completion of their grammar "
            "when the tokens left run out, so that they end valid (a request's "
            "close_within_budget overrides it): JSON schemas (tool calls included), all "
            "constraints, or none.",
            choices=("json_schema", "all", "off"),
        ),
    )

    def __post_init__(self) -> None:
        _check_choices(self)
        if self.grammar_backend == "reasoner" and not (
            self.think_end_token or self.reasoning_parser
        ):
            raise ValueError(
                "--grammar-backend reasoner needs --think-end-token or --reasoning-parser"
            )
        if self.think_budget is not None and self.think_budget < 0:
            raise ValueError("think_budget must be >= 0")
        if self.grammar_compile_timeout <= 0:
            raise ValueError("grammar_compile_timeout must be > 0")


@dataclass(frozen=True)
class KernelArgs:
    """Attention kernels, CUDA graphs and the start-up warm-up."""

    attention_backend: str = field(
        default="auto",
        metadata=_arg(
            "Attention kernels (auto: each phase takes the registered backend that ranks itself "
            "highest for this device: on CUDA FlashInfer prefill and Triton decode, Triton alone "
            "without FlashInfer; torch_native on CPU).",
            family="attention_backend",
            extra_choices=("auto",),
        ),
    )
    prefill_attention_backend: str | None = field(
        default=None,
        metadata=_arg(
            "Attention kernels for extend batches (prefill, chunked prefill) when they should "
            "differ from --attention-backend; both share the KV pool.",
            family="attention_backend",
            extra_choices=("auto",),
        ),
    )
    decode_attention_backend: str | None = field(
        default=None,
        metadata=_arg(
            "Attention kernels for decode batches (and their CUDA graphs) when they should "
            "differ from --attention-backend.",
            family="attention_backend",
            extra_choices=("auto",),
        ),
    )
    disable_cuda_graph: bool = field(
        default=False,
        metadata=_arg("Run decode eagerly instead of replaying captured CUDA graphs."),
    )
    cuda_graph_max_bs: int | None = field(
        default=None,
        metadata=_arg(
            "Largest decode batch captured as a CUDA graph (larger batches run eagerly). "
            "Default: --max-running-requests, up to 1024."
        ),
    )
    disable_piecewise_cuda_graph: bool = field(
        default=False,
        metadata=_arg(
            "Run extend batches (prefill, chunked prefill, mixed steps) eagerly instead of as "
            "piecewise CUDA graphs (the layers between attention calls captured per token-count "
            "bucket, attention run eagerly in between)."
        ),
    )
    disable_mixed_cuda_graph: bool = field(
        default=False,
        metadata=_arg(
            "With --enable-mixed-chunk, run mixed steps (a prefill chunk beside the decoding "
            "requests) as piecewise CUDA graphs instead of whole ones: by default each pair of "
            "a prompt-token bucket (up to the chunk size, at most 512) and a decode-row bucket "
            "is captured with its attention."
        ),
    )
    piecewise_cuda_graph_max_tokens: int = field(
        default=1024,
        metadata=_arg(
            "Largest extend batch, in tokens, run as piecewise CUDA graphs (larger ones run "
            "eagerly, where launch overhead is small beside their compute)."
        ),
    )
    skip_warmup: bool = field(
        default=False,
        metadata=_arg(
            "On a GPU, do not run the start-up warm-up (a few throwaway requests that compile "
            "the prefill and sampling kernels before the first real request)."
        ),
    )

    enable_torch_compile: bool = field(
        default=False,
        metadata=_arg(
            "Compile decode steps with torch.compile (Inductor) where they run eagerly: on the "
            "CPU, or on CUDA with --disable-cuda-graph (with CUDA graphs it is not applied). "
            "Needs a decode attention backend that "
            "traces whole (torch_native), no LoRA and one rank (no --tp-size); compiling takes "
            "about a minute per graph "
            "at start-up (cached on disk for the next start)."
        ),
    )
    torch_compile_max_bs: int = field(
        default=32,
        metadata=_arg("Largest decode batch run compiled (larger batches run eagerly)."),
    )

    def __post_init__(self) -> None:
        _positive(self, "cuda_graph_max_bs")
        _positive(self, "piecewise_cuda_graph_max_tokens")
        _positive(self, "torch_compile_max_bs")
