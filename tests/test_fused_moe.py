"""The fused MoE layer: routing and the experts against HF transformers' own sparse-MoE blocks, the
PyTorch path against a per-token loop, the Triton path (CPU: Triton's interpreter) against the
PyTorch path, and the weight loaders (per-expert and fused checkpoint names, TP slicing).
GPU-marked tests compare the paths in bf16 on CUDA and replay the Triton path in a CUDA graph."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from loom.distributed import set_tp
from loom.layers.moe import FusedMoE, TopKRouting, fused_experts_torch, select_experts

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

TINY = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2)
TINY.update(num_key_value_heads=1, head_dim=16, experts_implementation="eager")


def _configs():
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    moe = dict(num_experts=6, moe_intermediate_size=24, num_experts_per_tok=2)
    return {
        "mixtral": MixtralConfig(
            **TINY, intermediate_size=24, num_local_experts=6, num_experts_per_tok=2
        ),
        "qwen2_moe": Qwen2MoeConfig(
            **TINY, **moe, intermediate_size=40, shared_expert_intermediate_size=40
        ),
        "qwen2_moe-norm": Qwen2MoeConfig(
            **TINY,
            **moe,
            intermediate_size=40,
            shared_expert_intermediate_size=40,
            norm_topk_prob=True,
        ),  # fmt: skip
        # Qwen3-MoE checkpoints set norm_topk_prob (HF's default is False)
        "qwen3_moe": Qwen3MoeConfig(**TINY, **moe, intermediate_size=40, norm_topk_prob=True),
        "qwen3_moe-no-norm": Qwen3MoeConfig(
            **TINY, **moe, intermediate_size=40, norm_topk_prob=False
        ),
    }


def _hf_block(config):
    """HF's sparse-MoE block for ``config`` with random weights (well-separated router logits)."""
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cls = {"mixtral": MixtralSparseMoeBlock, "qwen2_moe": Qwen2MoeSparseMoeBlock}.get(
        config.model_type, Qwen3MoeSparseMoeBlock
    )
    block = cls(config).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.3)
    return block


def _loaded_experts(block, config, backend="torch") -> FusedMoE:
    """A FusedMoE filled from the HF block's own state dict (transformers 5's fused names)."""
    num_experts = getattr(config, "num_local_experts", None) or config.num_experts
    inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    moe = FusedMoE(num_experts, config.hidden_size, inter, backend=backend)
    _load(moe, block.state_dict().items(), "experts")
    return moe


def _load(moe: FusedMoE, weights, prefix: str) -> set[str]:
    mapping = {ckpt: rest for ckpt, *rest in moe.checkpoint_mapping(prefix, "")}
    params = {f".{n}": p for n, p in moe.named_parameters()}
    seen = set()
    for name, tensor in weights:
        if name in mapping:
            pname, expert_id, shard_id = mapping[name]
            param = params[pname]
            param.weight_loader(param, tensor, shard_id=shard_id, expert_id=expert_id)
            seen.add(name)
    return seen


@pytest.mark.parametrize(
    "name", ["mixtral", "qwen2_moe", "qwen2_moe-norm", "qwen3_moe", "qwen3_moe-no-norm"]
)
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_block_matches_hf(name, backend):
    """Same experts and weights as HF's router, same block output (fp32) as HF's block."""
    config = _configs()[name]
    block = _hf_block(config)
    h = torch.randn(11, config.hidden_size)
    with torch.no_grad():
        _, hf_weights, hf_ids = block.gate(h)
        want = block(h[None])[0]
        logits = F.linear(h, block.gate.weight)
        weights, ids = TopKRouting.from_config(config)(logits)
        moe = _loaded_experts(block, config, backend).to(DEVICE)
        got = moe(h.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE)).cpu()
        if name.startswith("qwen2_moe"):  # the shared expert, by HF's own modules
            got = got + torch.sigmoid(block.shared_expert_gate(h)) * block.shared_expert(h)
    assert torch.equal(ids, hf_ids)
    assert weights.dtype == hf_weights.dtype
    torch.testing.assert_close(weights, hf_weights, atol=0, rtol=0)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_router_bf16_matches_hf(name):
    """The order of the cast: Qwen's weights are rounded to bf16 after renormalising, Mixtral's
    stay fp32 (transformers 5)."""
    config = _configs()[name]
    block = _hf_block(config).to(torch.bfloat16)
    h = torch.randn(64, config.hidden_size, dtype=torch.bfloat16)
    with torch.no_grad():
        logits, hf_weights, hf_ids = block.gate(h)
    weights, ids = TopKRouting.from_config(config)(logits)
    assert torch.equal(ids, hf_ids)
    assert weights.dtype == hf_weights.dtype
    assert torch.equal(weights, hf_weights)
    assert weights.dtype == (torch.float32 if name == "mixtral" else torch.bfloat16)


def test_routing_rules():
    configs = _configs()
    assert TopKRouting.from_config(configs["mixtral"]) == TopKRouting(2, True, False)
    assert TopKRouting.from_config(configs["qwen2_moe"]) == TopKRouting(2, False, True)
    assert TopKRouting.from_config(configs["qwen3_moe"]) == TopKRouting(2, True, True)
    with pytest.raises(ValueError, match="known: \\['mixtral'"):
        TopKRouting.from_config(type("C", (), {"model_type": "llama"})())
    w, _ = select_experts(torch.randn(5, 8), 3, renormalize=True)
    torch.testing.assert_close(w.sum(-1), torch.ones(5))


def _random_moe(num_experts, hidden, inter, dtype=torch.float32, device="cpu") -> FusedMoE:
    moe = FusedMoE(num_experts, hidden, inter).to(device=device, dtype=dtype)
    with torch.no_grad():  # scaled so that activations stay O(1)
        moe.w13.normal_(0.0, hidden**-0.5)
        moe.w2.normal_(0.0, inter**-0.5)
    return moe


def _routing(num_tokens, num_experts, top_k, device="cpu", only=None):
    """Routing from random logits; ``only`` restricts the experts that receive tokens."""
    logits = torch.randn(num_tokens, num_experts, device=device)
    if only is not None:
        mask = torch.full((num_experts,), float("-inf"), device=device)
        mask[list(only)] = 0.0
        logits = logits + mask
    return select_experts(logits, top_k, renormalize=True)


def _per_token_loop(x, moe: FusedMoE, weights, ids):
    out = torch.zeros_like(x, dtype=torch.float32)
    inter = moe.intermediate_size_per_partition
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = moe.w13[e, :inter] @ x[t], moe.w13[e, inter:] @ x[t]
            out[t] += float(weights[t, j]) * (moe.w2[e] @ (F.silu(gate) * up)).float()
    return out.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "num_tokens,num_experts,top_k,only", [(1, 8, 2, None), (9, 4, 1, None), (6, 8, 3, (1, 5, 6))]
)
def test_torch_path_matches_per_token_loop(dtype, num_tokens, num_experts, top_k, only):
    moe = _random_moe(num_experts, 32, 48, dtype)
    x = torch.randn(num_tokens, 32, dtype=dtype)
    weights, ids = _routing(num_tokens, num_experts, top_k, only=only)
    got = fused_experts_torch(x, moe.w13, moe.w2, weights, ids)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    want = _per_token_loop(x, moe, weights, ids)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


# (T, E, k, H, I, experts that get tokens): T = 1; T < E; experts with no tokens (all rows on
# two experts, or on one); H and I not multiples of the tiles; a non-power-of-two E
_TRITON_SHAPES = [
    (1, 8, 2, 64, 128, None),
    (3, 8, 2, 40, 24, None),
    (5, 6, 2, 32, 48, (0, 4)),
    (4, 8, 1, 32, 40, (7,)),
    (17, 5, 3, 48, 32, None),
]


@needs_triton
@pytest.mark.parametrize("num_tokens,num_experts,top_k,hidden,inter,only", _TRITON_SHAPES)
def test_triton_path_matches_torch(num_tokens, num_experts, top_k, hidden, inter, only):
    from loom.layers.moe.triton_moe import GemmConfig, MoEConfig, fused_experts

    moe = _random_moe(num_experts, hidden, inter, device=DEVICE)
    x = torch.randn(num_tokens, hidden, device=DEVICE)
    weights, ids = _routing(num_tokens, num_experts, top_k, DEVICE, only)
    want = moe(x, weights, ids, backend="torch")
    torch.testing.assert_close(moe(x, weights, ids, backend="triton"), want, atol=1e-5, rtol=1e-5)
    # tiles smaller than H and I (several N tiles and K steps, partial last ones)
    small = MoEConfig(16, GemmConfig(16, 16, group_m=2), GemmConfig(32, 16, group_m=2))
    got = fused_experts(x, moe.w13, moe.w2, weights, ids, small)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("block_m", [4, 16])
@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 8, 2), (3, 8, 2), (40, 6, 2)])
def test_align_groups_rows_by_expert(block_m, num_tokens, num_experts, top_k):
    from loom.layers.moe.triton_moe import align_rows, max_padded_rows

    _, ids = _routing(num_tokens, num_experts, top_k, DEVICE)
    a = align_rows(ids, num_experts, block_m)
    rows = num_tokens * top_k
    flat = ids.reshape(-1).cpu()
    sorted_ids, expert_ids = a.sorted_ids.cpu().long(), a.expert_ids.cpu().long()
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    assert int(a.num_post_padded) == int(padded.sum())
    assert sorted_ids.numel() >= max_padded_rows(rows, num_experts, block_m) >= int(padded.sum())
    valid = sorted_ids[: int(padded.sum())]
    real = valid[valid < rows]
    assert sorted(real.tolist()) == list(range(rows))  # every routed row exactly once
    assert (sorted_ids[int(padded.sum()) :] == rows).all()  # the rest are pads
    block_of = torch.arange(valid.numel()) // block_m
    for pos, row in enumerate(valid.tolist()):
        if row < rows:
            assert flat[row] == expert_ids[block_of[pos]]
    # groups in expert order, rows in their original order within a group (a stable sort)
    assert real.tolist() == torch.argsort(flat, stable=True).tolist()


@needs_triton
def test_triton_path_empty_batch():
    moe = _random_moe(4, 32, 32, device=DEVICE)
    x = torch.empty(0, 32, device=DEVICE)
    ids = torch.empty(0, 2, dtype=torch.long, device=DEVICE)
    out = moe(x, torch.empty(0, 2, device=DEVICE), ids, backend="triton")
    assert out.shape == (0, 32)


def test_backend_selection():
    moe = _random_moe(4, 32, 32)
    from loom.layers.moe.fused_moe import pick_backend

    assert pick_backend(torch.empty(1)) == "torch"
    assert pick_backend(torch.empty(1), "triton") == "triton"
    with pytest.raises(ValueError, match="known: auto, torch, triton"):
        FusedMoE(4, 32, 32, backend="cutlass")
    with pytest.raises(ValueError, match="unknown MoE backend"):
        moe(torch.randn(1, 32), *_routing(1, 4, 2), backend="cutlass")


def test_weight_loader_per_expert_and_fused():
    """Per-expert matrices (both naming schemes), fused [E, 2I, H] / [E, H, I] tensors and
    their transposes all load to the same parameters (tp_size 1)."""
    torch.manual_seed(0)
    num_experts, hidden, inter = 3, 8, 6
    gate = torch.randn(num_experts, inter, hidden)
    up = torch.randn(num_experts, inter, hidden)
    down = torch.randn(num_experts, hidden, inter)
    want13, want2 = torch.cat([gate, up], dim=1), down
    qwen = [
        (f"experts.{e}.{n}.weight", w[e])
        for e in range(num_experts)
        for n, w in (("gate_proj", gate), ("up_proj", up), ("down_proj", down))
    ]
    mixtral = [
        (f"experts.{e}.{n}.weight", w[e])
        for e in range(num_experts)
        for n, w in (("w1", gate), ("w3", up), ("w2", down))
    ]
    fused = [("experts.gate_up_proj", want13), ("experts.down_proj", want2)]
    fused_t = [(n, w.transpose(1, 2)) for n, w in fused]
    for weights in (qwen, mixtral, fused, fused_t):
        moe = FusedMoE(num_experts, hidden, inter)
        assert _load(moe, weights, "experts") == {n for n, _ in weights}
        assert torch.equal(moe.w13, want13) and torch.equal(moe.w2, want2)
    moe = FusedMoE(num_experts, hidden, inter)
    moe.w2.weight_loader(moe.w2, want2)  # shard_id None: the parameter's fused matrix
    assert torch.equal(moe.w2, want2)
    with pytest.raises(ValueError, match="shape mismatch"):
        moe.w13.weight_loader(moe.w13, gate[0, :, :4], shard_id="gate", expert_id=0)
    with pytest.raises(ValueError, match="does not belong"):
        moe.w2.weight_loader(moe.w2, gate[0], shard_id="gate", expert_id=0)


def test_weight_loader_tensor_parallel_slices():
    """Two TP ranks' slices of the intermediate dimension: their partial outputs sum to the
    full layer's output."""
    torch.manual_seed(0)
    num_experts, hidden, inter = 4, 16, 24
    full = _random_moe(num_experts, hidden, inter)
    weights = [
        (f"experts.{e}.{n}.weight", w)
        for e in range(num_experts)
        for n, w in (
            ("gate_proj", full.w13[e, :inter]),
            ("up_proj", full.w13[e, inter:]),
            ("down_proj", full.w2[e]),
        )
    ]
    fused = [("experts.gate_up_proj", full.w13.data), ("experts.down_proj", full.w2.data)]
    x = torch.randn(7, hidden)
    routing = _routing(7, num_experts, 2)
    want = full(x, *routing)
    for ckpt in (weights, fused):
        parts = []
        try:
            for rank in range(2):
                set_tp(rank, 2)
                shard = FusedMoE(num_experts, hidden, inter, reduce_results=False)
                _load(shard, ckpt, "experts")
                assert shard.w13.shape == (num_experts, inter, hidden)
                parts.append(shard(x, *routing))
        finally:
            set_tp(0, 1)
        torch.testing.assert_close(parts[0] + parts[1], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_checkpoint_names_transformers_writes(tmp_path, name):
    """What transformers 5 writes: ``save_pretrained`` reverts to the hub's per-expert names
    (Mixtral under ``block_sparse_moe``), while ``state_dict()`` holds the fused tensors under
    ``mlp.experts``; both load the same FusedMoE."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    config = _configs()[name]
    model = AutoModelForCausalLM.from_config(config).eval()
    state = model.state_dict()
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape == (6, 48, 32)
    assert state["model.layers.0.mlp.experts.down_proj"].shape == (6, 32, 24)
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    prefix = "model.layers.0." + ("block_sparse_moe" if name == "mixtral" else "mlp") + ".experts"
    leaf = "w1" if name == "mixtral" else "gate_proj"
    assert saved[f"{prefix}.0.{leaf}.weight"].shape == (24, 32)
    assert not any("gate_up_proj" in k for k in saved)
    want = _load_fused_from(state.items(), "model.layers.0.mlp.experts")
    got = _load_fused_from(saved.items(), prefix)
    assert torch.equal(got.w13, want.w13) and torch.equal(got.w2, want.w2)


def _load_fused_from(weights, prefix) -> FusedMoE:
    moe = FusedMoE(6, 32, 24)
    loaded = _load(moe, ((n[len(prefix) :], w) for n, w in weights if n.startswith(prefix)), "")
    assert loaded, f"nothing under {prefix}"
    return moe


# -- CUDA ----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(
    "num_tokens,num_experts,top_k", [(1, 8, 2), (7, 8, 2), (64, 8, 2), (300, 8, 2), (33, 64, 8)]
)
def test_cuda_triton_matches_torch_bf16(num_tokens, num_experts, top_k):
    moe = _random_moe(num_experts, 512, 1024, torch.bfloat16, "cuda")
    x = torch.randn(num_tokens, 512, device="cuda", dtype=torch.bfloat16)
    weights, ids = _routing(num_tokens, num_experts, top_k, "cuda")
    got = moe(x, weights, ids)  # auto: Triton on CUDA
    want = moe(x, weights, ids, backend="torch")
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
def test_cuda_graph_replays_routing_and_experts():
    """Router + experts captured once at T=4, replayed with new hidden states and new router
    weights (other experts chosen): each replay equals the eager PyTorch path."""
    torch.manual_seed(0)
    num_experts, hidden, inter, top_k = 8, 256, 512, 2
    moe = _random_moe(num_experts, hidden, inter, torch.bfloat16, "cuda")
    router = torch.randn(num_experts, hidden, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(4, hidden, device="cuda", dtype=torch.bfloat16)

    def step():
        weights, ids = select_experts(F.linear(x, router), top_k, renormalize=True)
        return moe(x, weights, ids, backend="triton")

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        router.copy_(torch.randn_like(router))
        graph.replay()
        weights, ids = select_experts(F.linear(x, router), top_k, renormalize=True)
        want = moe(x, weights, ids, backend="torch")
        torch.testing.assert_close(out.float(), want.float(), atol=3e-2, rtol=3e-2)
