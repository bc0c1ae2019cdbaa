"""Loom's rotary tables and rotations against HF transformers' rotary embeddings, for every rope
type, with HF driven one position at a time (its cached generate) past the length thresholds."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma3TextConfig, LlamaConfig, Phi3Config
from transformers.models.llama import modeling_llama
from transformers.models.phi3 import modeling_phi3

from loom.layers.rotary import RotaryEmbedding, context_length, get_rope, rope_params

HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, MAX_POS = 32, 4, 2, 64
ATOL = 1e-5


def _llama(**kwargs) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=HEAD_DIM * NUM_HEADS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        max_position_embeddings=MAX_POS,
        **kwargs,
    )


def _factors(start: float, stop: float, n: int) -> list[float]:
    return torch.linspace(start, stop, n).tolist()


def _phi3() -> Phi3Config:
    # head_dim 32, 24 of them rotated; factor inferred as 256 / 64.
    return Phi3Config(
        hidden_size=HEAD_DIM * NUM_HEADS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        max_position_embeddings=4 * MAX_POS,
        original_max_position_embeddings=MAX_POS,
        partial_rotary_factor=0.75,
        rope_scaling={
            "type": "longrope",
            "short_factor": _factors(1.0, 1.3, 12),
            "long_factor": _factors(1.0, 6.0, 12),
        },
    )


LLAMA, PHI3 = modeling_llama, modeling_phi3
# name: (config, HF modeling module, positions Loom's table covers)
CASES = {
    "default": (lambda: _llama(), LLAMA, MAX_POS),
    "linear-4.x-layout": (
        lambda: _llama(rope_scaling={"type": "linear", "factor": 2.0}, rope_theta=20000.0),
        LLAMA,
        2 * MAX_POS,
    ),
    "dynamic": (
        lambda: _llama(rope_parameters={"rope_type": "dynamic", "factor": 4.0}),
        LLAMA,
        4 * MAX_POS,
    ),
    "yarn": (  # Qwen-style: max_position_embeddings is the pre-scaling length
        lambda: _llama(
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": MAX_POS,
                "rope_theta": 1e6,
            }
        ),
        LLAMA,
        4 * MAX_POS,
    ),
    "yarn-mscale": (  # DeepSeek-style attention factor, untruncated correction range
        lambda: _llama(
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": MAX_POS // 4,
                "mscale": 1.0,
                "mscale_all_dim": 0.5,
                "beta_fast": 16,
                "beta_slow": 2,
                "truncate": False,
            }
        ),
        LLAMA,
        MAX_POS,
    ),
    "yarn-attention-factor": (
        lambda: _llama(
            rope_parameters={
                "rope_type": "yarn",
                "factor": 2.0,
                "original_max_position_embeddings": MAX_POS // 2,
                "attention_factor": 0.9,
            }
        ),
        LLAMA,
        MAX_POS,
    ),
    "llama3": (
        lambda: _llama(
            rope_parameters={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": MAX_POS // 2,
                "rope_theta": 500000.0,
            }
        ),
        LLAMA,
        MAX_POS,
    ),
    "longrope": (
        lambda: _llama(
            rope_parameters={
                "rope_type": "longrope",
                "short_factor": _factors(1.0, 1.5, HEAD_DIM // 2),
                "long_factor": _factors(1.0, 8.0, HEAD_DIM // 2),
                "original_max_position_embeddings": MAX_POS // 4,
                "factor": 4.0,
            }
        ),
        LLAMA,
        MAX_POS,
    ),
    "phi3-longrope-partial": (_phi3, PHI3, 4 * MAX_POS),
}


def _loom_rope(config) -> RotaryEmbedding:
    """The rope as ``LlamaAttention`` builds it."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    theta, scaling = rope_params(config)
    rotary_dim = int(head_dim * getattr(config, "partial_rotary_factor", 1.0))
    return get_rope(head_dim, rotary_dim, config.max_position_embeddings, theta, scaling)


def _hf_token_by_token(hf_rope, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's cos/sin ``[num_positions, rotary_dim]`` as its cached generate computes them: one
    forward per position, in order, on one stateful module."""
    x = torch.zeros(1)
    out = [hf_rope(x, torch.tensor([[p]])) for p in range(num_positions)]
    return torch.cat([c[0] for c, _ in out]), torch.cat([s[0] for _, s in out])


@pytest.mark.parametrize("name", list(CASES))
def test_tables_and_rotation_match_hf(name):
    make_config, hf_module, num_positions = CASES[name]
    config = make_config()
    rope = _loom_rope(config)
    assert rope.num_positions == num_positions
    head_dim, rotary_dim = rope.head_dim, rope.rotary_dim
    hf_rope = getattr(hf_module, type(config).__name__.replace("Config", "RotaryEmbedding"))
    cos, sin = _hf_token_by_token(hf_rope(config), num_positions)
    assert cos.shape == (num_positions, rotary_dim)
    torch.testing.assert_close(torch.cat((rope.cos_cache,) * 2, -1), cos, rtol=0, atol=ATOL)
    torch.testing.assert_close(torch.cat((rope.sin_cache,) * 2, -1), sin, rtol=0, atol=ATOL)

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(num_positions, NUM_HEADS * head_dim, generator=gen)
    k = torch.randn(num_positions, NUM_KV_HEADS * head_dim, generator=gen)
    got_q, got_k = rope(torch.arange(num_positions), q.clone(), k.clone())

    def heads(x, n):  # [T, n * D] -> HF's [1, n, T, D]
        return x.view(1, num_positions, n, head_dim).transpose(1, 2)

    want_q, want_k = hf_module.apply_rotary_pos_emb(
        heads(q, NUM_HEADS), heads(k, NUM_KV_HEADS), cos[None], sin[None]
    )
    # A rotated element is x1 * cos -/+ x2 * sin: the tables' tolerance times up to 2 max|x|.
    for got, want, x in ((got_q, want_q, q), (got_k, want_k, k)):
        atol = 2 * ATOL * x.abs().max().item()
        torch.testing.assert_close(got, want.transpose(1, 2).reshape(x.shape), rtol=0, atol=atol)
    if name != "default":  # the case exercises a scaling
        plain = RotaryEmbedding(head_dim, rotary_dim, num_positions, rope_params(config)[0])
        assert (rope.cos_cache - plain.cos_cache).abs().max() > 1e-2


@pytest.mark.parametrize("name", ["dynamic", "longrope"])
def test_rows_below_threshold_are_hf_short_sequence_rows(name):
    """Rows below the threshold equal HF's forward over a sequence within it; HF's forward over a
    longer sequence rotates those positions differently (the documented divergence)."""
    config = CASES[name][0]()
    params = config.rope_parameters
    threshold = params.get("original_max_position_embeddings", config.max_position_embeddings)
    rope = _loom_rope(config)
    x = torch.zeros(1)
    short, _ = modeling_llama.LlamaRotaryEmbedding(config)(x, torch.arange(threshold)[None])
    long, _ = modeling_llama.LlamaRotaryEmbedding(config)(x, torch.arange(2 * threshold)[None])
    loom = torch.cat((rope.cos_cache,) * 2, -1)
    torch.testing.assert_close(loom[:threshold], short[0], rtol=0, atol=ATOL)
    assert (loom[:threshold] - long[0, :threshold]).abs().max() > 1e-2


def test_su_is_longrope():
    config = _phi3()
    theta, scaling = rope_params(config)
    su = {k: v for k, v in scaling.items() if k not in ("type", "rope_type")} | {"type": "su"}
    rope = RotaryEmbedding(HEAD_DIM, 24, config.max_position_embeddings, theta, su)
    assert torch.equal(rope.cos_cache, _loom_rope(config).cos_cache)


def test_rope_params_per_layer_type():
    config = Gemma3TextConfig(rope_scaling={"rope_type": "linear", "factor": 8.0})
    with pytest.raises(ValueError, match="layer_type"):
        rope_params(config)
    assert rope_params(config, "sliding_attention") == (10000.0, None)
    theta, scaling = rope_params(config, "full_attention")
    assert theta == 1e6 and scaling["rope_type"] == "linear" and scaling["factor"] == 8.0


def test_get_rope_shares_only_identical_tables():
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    rope = get_rope(HEAD_DIM, HEAD_DIM, MAX_POS, 1e4, yarn)
    legacy = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    assert get_rope(HEAD_DIM, HEAD_DIM, MAX_POS, 1e4, legacy) is rope
    others = [
        get_rope(HEAD_DIM, HEAD_DIM, MAX_POS, 1e4, {**yarn, "factor": 2.0}),
        get_rope(
            HEAD_DIM, HEAD_DIM, MAX_POS, 1e4, {**yarn, "original_max_position_embeddings": 16}
        ),
        get_rope(HEAD_DIM, HEAD_DIM, MAX_POS, 1e4, {**yarn, "beta_fast": 8}),
        get_rope(HEAD_DIM, HEAD_DIM, 2 * MAX_POS, 1e4, yarn),
        get_rope(HEAD_DIM, HEAD_DIM, MAX_POS, 1e5, yarn),
        get_rope(HEAD_DIM, HEAD_DIM // 2, MAX_POS, 1e4, yarn),
        get_rope(HEAD_DIM, HEAD_DIM, MAX_POS, 1e4, None),
    ]
    assert all(other is not rope for other in others)
    assert len({id(other) for other in others}) == len(others)


def test_unsupported_type_names_the_supported_ones():
    with pytest.raises(ValueError, match="longrope"):
        RotaryEmbedding(HEAD_DIM, HEAD_DIM, MAX_POS, 1e4, {"rope_type": "mrope"})


@pytest.mark.parametrize(
    "rope, want",
    [
        (None, 4096),
        ({"rope_type": "linear", "factor": 4.0}, 16384),
        ({"type": "dynamic", "factor": 2.0}, 8192),
        # yarn stretches its pre-scaling length, not max_position_embeddings
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}, 8192),
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}, 16384),
        # these state the extended length in max_position_embeddings already
        (
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 1024,
            },
            4096,
        ),
    ],
)
def test_context_length_is_vllms_rule(rope, want):
    """vLLM's rule (``_get_and_verify_max_len``): the factor multiplies the pre-scaling length
    for linear, dynamic and yarn; the model's tables cover exactly that length."""
    config = LlamaConfig(
        hidden_size=HEAD_DIM * NUM_HEADS,
        num_attention_heads=NUM_HEADS,
        max_position_embeddings=4096,
        rope_scaling=rope,
    )
    assert context_length(config) == want
    theta, scaling = rope_params(config)
    rope_emb = get_rope(HEAD_DIM, HEAD_DIM, 4096, theta, scaling, num_positions=want)
    assert rope_emb.num_positions == want


def test_gemma3_states_its_scaled_length():
    """Gemma 3's global layers scale linearly by 8, and its max_position_embeddings is already
    the scaled length (vLLM's exception): the context is not stretched again."""
    config = Gemma3TextConfig(
        hidden_size=HEAD_DIM * NUM_HEADS,
        num_attention_heads=NUM_HEADS,
        max_position_embeddings=4096,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    )
    assert context_length(config) == 4096
    # the same scaling on another model type stretches it
    config.model_type = "llama"
    assert context_length(config) == 8 * 4096


def test_context_length_past_the_models_is_refused(tmp_path):
    from loom.config.server_args import ServerArgs
    from loom.model_executor.weights import model_config_for
    from tests.conftest import save_tiny_llama

    path = save_tiny_llama(tmp_path / "m", max_position_embeddings=512)
    args = ServerArgs(model=path, context_length=256)
    assert model_config_for(args, torch.float32)[1].context_len == 256
    with pytest.raises(ValueError, match="--context-length 1024 is longer than the model's 512"):
        model_config_for(ServerArgs(model=path, context_length=1024), torch.float32)
