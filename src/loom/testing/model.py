"""Conformance kit of the model family: a ``CausalLM`` built, loaded and run as Loom's loaders and
model runner do, against HF transformers' model of the same config and weights."""

from __future__ import annotations

import random
import tempfile
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from loom import plugins
from loom.model_loader.base import default_dtype
from loom.testing._common import (
    TINY_LLAMA,
    PagedForward,
    hf_logits,
    poisoned_parameters,
    read_safetensors,
    save_tiny_llama,
    tiny_llama_config,
    unwritten_parameters,
)

# Each built-in architecture's HF model type and what its tiny config sets beyond TINY_LLAMA:
# sliding windows shorter than the kit's prompts and small soft-caps, so that they bind.
TINY_ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "LlamaForCausalLM": ("llama", {}),
    "MistralForCausalLM": ("mistral", {"sliding_window": 8, "head_dim": 16}),
    "Qwen2ForCausalLM": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
    ),
    "Qwen3ForCausalLM": ("qwen3", {"head_dim": 32}),
    "Phi3ForCausalLM": ("phi3", {"partial_rotary_factor": 0.5, "pad_token_id": 0}),
    "Gemma2ForCausalLM": (
        "gemma2",
        {
            "head_dim": 16,
            "sliding_window": 8,
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 3.0,
        },
    ),
    "Gemma3ForCausalLM": (
        "gemma3_text",
        {
            "head_dim": 16,
            "sliding_window": 8,
            "query_pre_attn_scalar": 24,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    "MixtralForCausalLM": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "Qwen2MoeForCausalLM": (
        "qwen2_moe",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [1],
            "norm_topk_prob": False,
        },
    ),
    "Qwen3MoeForCausalLM": (
        "qwen3_moe",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": True,
            "head_dim": 32,
        },
    ),
}


def tiny_config(architecture: str, **overrides: Any) -> Any:
    """A tiny HF config (2 layers, grouped-query attention) of a built-in architecture."""
    from transformers import AutoConfig

    model_type, extra = TINY_ARCHITECTURES[architecture]
    kw = {**TINY_LLAMA, **extra, **overrides}
    return AutoConfig.for_model(model_type, architectures=[architecture], **kw)


def _close(name: str, what: str, got: torch.Tensor, want: torch.Tensor, atol: float) -> None:
    assert got.shape == want.shape, f"{name}: {what}: logits shape {tuple(got.shape)}"
    assert bool(torch.isfinite(got).all()), f"{name}: {what}: logits are not finite"
    err = (got.float().cpu() - want).abs().max().item()
    # tolerance relative to the logits' scale (ones of a few units: like an absolute atol)
    assert err <= atol * max(1.0, want.abs().max().item()), f"{name}: {what}: off by {err:.2e}"


def compare_forwards(
    name: str,
    model: nn.Module,
    hf_config: Any,
    reference: nn.Module | None,
    device: torch.device,
    dtype: torch.dtype,
    atol: float,
    seed: int = 0,
    attention_backend: str = "torch_native",
) -> None:
    """Three batches through ``model`` on a paged pool: an extend of new requests (logits of each
    last token: ``[batch_size, vocab]``), an extend of more tokens on top of their cached prefixes
    beside a new request with ``logit_indices`` set to every token (``[num_tokens, vocab]``),
    and a decode step. Against ``reference`` (an HF model) when given, else only shapes, dtype
    and finiteness are checked."""
    rng = random.Random(seed)
    vocab = hf_config.vocab_size
    fwd = PagedForward(model, hf_config, device, dtype, attention_backend, seed)
    first = [9, 1, 17]  # phase 1: prompts of three requests
    more = [6, 0, 3]  # phase 2: more tokens for them (0: request 1 sits this one out)
    seqs = [
        [rng.randrange(vocab) for _ in range(a + b + 1)] for a, b in zip(first, more, strict=True)
    ]
    seqs.append([rng.randrange(vocab) for _ in range(6)])  # a new request in phase 2
    rows = [fwd.new_request(len(s)) for s in seqs]
    want = [hf_logits(reference, s) for s in seqs] if reference is not None else None

    def check(what: str, got: torch.Tensor, ref_rows: list[torch.Tensor]) -> None:
        assert isinstance(got, torch.Tensor) and got.dtype == torch.float32, (
            f"{name}: {what}: forward must return float32 logits"
        )
        assert got.shape == (len(ref_rows), vocab), (
            f"{name}: {what}: logits shape {tuple(got.shape)}, want {(len(ref_rows), vocab)}"
        )
        if want is None:
            assert bool(torch.isfinite(got).all()), f"{name}: {what}: logits are not finite"
        else:
            _close(name, what, got, torch.stack(ref_rows), atol)

    out = fwd.extend(rows[:3], [0, 0, 0], [s[:n] for s, n in zip(seqs[:3], first, strict=True)])
    check("extend", out, [want[i][n - 1] for i, n in enumerate(first)] if want else [0] * 3)
    # phase 2: requests 0 and 2 continue after their cached prompts; request 3 is new
    idx = [0, 2, 3]
    prefixes = [first[0], first[2], 0]
    chunks = [seqs[0][first[0] : first[0] + more[0]], seqs[2][first[2] : first[2] + more[2]]]
    chunks.append(seqs[3][:-1])
    num = sum(len(c) for c in chunks)
    out = fwd.extend([rows[i] for i in idx], prefixes, chunks, logit_indices=list(range(num)))
    ref_rows = []
    for i, p, c in zip(idx, prefixes, chunks, strict=True):
        ref_rows += [want[i][p + j] for j in range(len(c))] if want else [0] * len(c)
    check("extend over a cached prefix (logit_indices: every token)", out, ref_rows)
    # phase 3: one decode step for every request, on top of everything it has cached
    positions = [len(s) - 1 for s in seqs]
    out = fwd.decode(rows, positions, [s[-1] for s in seqs])
    check("decode", out, [w[-1] for w in want] if want else [0] * 4)


def _resolve(model: str | type) -> tuple[str, type]:
    from loom.models.base import CausalLM

    cls = plugins.resolve("model", model) if isinstance(model, str) else model
    name = model if isinstance(model, str) else getattr(cls, "__name__", repr(cls))
    assert isinstance(cls, type) and issubclass(cls, CausalLM), (
        f"{name}: a model must be a subclass of loom.models.base.CausalLM"
    )
    return name, cls


def check_model(
    model: str | type,
    hf_config: Any = None,
    reference: str | Callable[[Any], nn.Module] | None = "auto",
    weights: dict[str, torch.Tensor] | None = None,
    device: str | torch.device = "cpu",
    atol: float = 1e-4,
    seed: int = 0,
    attention_backend: str = "torch_native",
) -> None:
    """``model``: a registered architecture name or a ``CausalLM`` class. ``hf_config``: the HF
    config to build (default: a tiny Llama with grouped-query attention). ``reference``: the
    oracle, HF transformers' model of the config (``"auto"``: ``AutoModelForCausalLM``; a
    callable taking the config; None: none, then ``weights`` is the checkpoint).

    Checks: ``kv_cache_shape(config)`` gives (layers, kv_heads, head_dim) that the model's
    attention layers use, one layer id per layer of the config; the constructor takes the config
    alone (as the loaders call it) and builds parameters in the default dtype on the default
    device; ``load_weights`` takes the checkpoint's (HF name, tensor) pairs in any order, writes
    every parameter and returns their names; forward over extend batches (with and without
    cached prefixes, with ``logit_indices``) and a decode batch on a paged pool returns float32
    logits of ``[batch_size or len(logit_indices), vocab]`` equal to the reference's (fp32)."""
    from transformers import AutoModelForCausalLM

    from loom.layers.attention.layer import Attention
    from loom.model_loader.base import process_weights_after_loading

    name, cls = _resolve(model)
    device = torch.device(device)
    config = hf_config if hf_config is not None else tiny_llama_config(architectures=[name])
    shape = cls.kv_cache_shape(config)
    assert (
        isinstance(shape, tuple)
        and len(shape) == 3
        and all(isinstance(x, int) and x > 0 for x in shape)
    ), f"{name}: kv_cache_shape must be (layers, kv_heads, head_dim) of ints, not {shape!r}"
    assert shape[0] == config.num_hidden_layers, (
        f"{name}: kv_cache_shape gives {shape[0]} layers, the config {config.num_hidden_layers}"
    )

    hf = None
    if reference is not None:
        build = AutoModelForCausalLM.from_config if reference == "auto" else reference
        with tempfile.TemporaryDirectory(prefix="loom-kit-model-") as tmp:
            torch.manual_seed(seed)
            hf = build(config).float().eval()
            hf.save_pretrained(tmp)  # the checkpoint's names (tied weights saved once)
            weights = read_safetensors(tmp)
    if weights is None:
        raise ValueError(f"{name}: check_model needs a reference model or the weights")

    with default_dtype(torch.bfloat16):  # the loaders build in the model's dtype this way
        half = cls(config)
    wrong = [
        n for n, p in half.named_parameters() if p.is_floating_point() and p.dtype != torch.bfloat16
    ]
    assert not wrong, f"{name}: parameters {wrong[:4]} ignore the default dtype"
    del half
    with default_dtype(torch.float32), torch.device(device), poisoned_parameters():
        m = cls(config)
    assert all(p.device.type == device.type for p in m.parameters()), (
        f"{name}: parameters must be built on the default device"
    )
    layers = [mod for mod in m.modules() if isinstance(mod, Attention)]
    assert sorted(a.layer_id for a in layers) == list(range(shape[0])), (
        f"{name}: attention layer ids {[a.layer_id for a in layers]} do not match kv_cache_shape"
    )
    for a in layers:
        assert (a.num_kv_heads, a.head_dim) == shape[1:], (
            f"{name}: layer {a.layer_id} reads {a.num_kv_heads} KV heads of {a.head_dim}, "
            f"kv_cache_shape says {shape[1:]}"
        )

    items = list(weights.items())
    random.Random(seed).shuffle(items)  # checkpoints come in file order, not model order
    try:
        loaded = m.load_weights(iter(items))
    except Exception as e:
        raise AssertionError(f"{name}: load_weights failed on a complete checkpoint: {e!r}") from e
    missing = sorted({n for n, _ in m.named_parameters()} - set(loaded or ()))
    assert not missing, f"{name}: load_weights does not report loading {missing[:4]}"
    unwritten = unwritten_parameters(m)
    assert not unwritten, f"{name}: load_weights never wrote {unwritten[:4]}"
    m = process_weights_after_loading(m)
    compare_forwards(name, m, config, hf, device, torch.float32, atol, seed, attention_backend)


def _hf_greedy(hf: nn.Module, prompts: list[list[int]], n: int) -> list[list[int]]:
    out = []
    for ids in prompts:
        x = torch.tensor([ids])
        with torch.inference_mode():
            # An explicit mask: else HF masks every prompt token equal to pad_token_id.
            y = hf.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
        out.append(y[0, len(ids) :].tolist())
    return out


def check_model_engine(
    hf_config: Any,
    prompt_lens: tuple[int, ...] = (5, 19, 26, 40),
    max_new_tokens: int = 32,
    seed: int = 0,
    **engine_args: Any,
) -> None:
    """The engine on a saved checkpoint of ``hf_config`` (HF's random model, seeded) against
    transformers' greedy ``generate`` of the same weights, fp32 on CPU: ``max_new_tokens``
    greedy tokens of each prompt equal HF's when each runs alone, when all run batched
    together, and through 8-token prefill chunks in a pool so small that requests are retracted
    and recomputed (which must happen). Prompts should be longer than any sliding window.
    ``engine_args``: more arguments of both engines (e.g. ``model_impl="transformers"``)."""
    import loom

    rng = random.Random(seed)
    vocab = hf_config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in prompt_lens]
    params = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}
    name = hf_config.architectures[0]
    with tempfile.TemporaryDirectory(prefix="loom-kit-engine-") as tmp:
        hf = save_tiny_llama(tmp, hf_config, seed)
        want = _hf_greedy(hf, prompts, max_new_tokens)
        kw = dict(model=tmp, device="cpu", dtype="float32", skip_tokenizer_init=True)
        kw.update(engine_args)
        with loom.Engine(max_total_tokens=4096, **kw) as e:
            alone = [e.generate(input_ids=p, sampling_params=params)["output_ids"] for p in prompts]
            batched = [
                o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=params)
            ]
        # room for the longest request and a little more: the others must wait or be retracted
        pool = max(prompt_lens) + max_new_tokens + 24
        with loom.Engine(
            max_total_tokens=pool, chunked_prefill_size=8, schedule_conservativeness=0.0, **kw
        ) as e:
            chunked = [
                o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=params)
            ]
            retractions = e.scheduler.stats.num_retractions
            e.scheduler.check_kv_balance()
    for what, got in (("alone", alone), ("batched", batched), ("chunked, retracted", chunked)):
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert g == w, f"{name}: prompt {i} ({what}): greedy tokens {g} differ from HF's {w}"
    assert retractions > 0, f"{name}: the small pool retracted nothing"
