"""``--quantization bitsandbytes``: NF4 / FP4 and LLM.int8() linear layers on bitsandbytes' kernels.

Oracles: plain PyTorch decoding each layer's stored bytes (the 4-bit code table, int8 rows and
their scales) and multiplying (the layer), transformers' own bitsandbytes modules and model on
the same weights and ``BitsAndBytesConfig`` (the checkpoint format and the model), and HF's dense
model (what 4-bit costs on the default model)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("bitsandbytes")

import bitsandbytes.functional as F  # noqa: E402

import loom  # noqa: E402
from loom.config import ServerArgs  # noqa: E402
from loom.layers.linear import (  # noqa: E402
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from loom.layers.quantization.bitsandbytes import (  # noqa: E402
    BitsAndBytesLinearMethod,
    BitsAndBytesQuantization,
    BnbSpec,
)
from tests.conftest import CHAT_PROMPTS, chat_ids, hf_top1_agreement, save_tiny_llama  # noqa: E402


def _layers(spec: BnbSpec, seed: int = 0):
    """A QKV (with bias), a gate/up and a down layer given ``spec``'s method, loaded from random
    dense parts through their own loaders and quantized; returns them with their dense parts."""
    gen = torch.Generator().manual_seed(seed)
    qkv = QKVParallelLinear(64, 16, 4, 2, bias=True)
    merged, row = MergedColumnParallelLinear(64, [96, 96]), RowParallelLinear(192, 64)
    parts = {
        qkv: [("q", 64), ("k", 32), ("v", 32)],
        merged: [(0, 96), (1, 96)],
        row: [(None, 64)],
    }
    dense = {}
    for layer, shards in parts.items():
        layer.quant_method = BitsAndBytesLinearMethod(spec)
        layer.quant_method.create_weights(layer)
        in_features = layer.weight.shape[1]
        dense[layer] = []
        for sid, rows in shards:
            w = torch.randn(rows, in_features, generator=gen) * 0.05
            layer.weight.weight_loader(layer.weight, w, *([] if sid is None else [sid]))
            dense[layer].append(w)
        if layer.bias is not None:
            layer.bias.data.copy_(torch.randn(layer.bias.shape, generator=gen))
        layer.process_weights_after_loading()
        assert layer.weight is None
    return dense


def _decode_4bit(q: torch.Tensor, absmax: torch.Tensor, quant_type: str, shape) -> torch.Tensor:
    """Plain PyTorch: byte i holds element 2i in its high nibble and 2i + 1 in its low one; each
    element is its code's value times its block's absmax."""
    q = q.reshape(-1)
    idx = torch.stack([q >> 4, q & 0x0F], dim=-1).reshape(-1).long()
    code = F.get_4bit_type(quant_type, device="cpu")
    return (code[idx].reshape(absmax.numel(), -1) * absmax.reshape(-1, 1)).reshape(shape)


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_4bit_packed_layers_hold_each_parts_bytes_and_match_the_decoded_matmul(
    quant_type, monkeypatch
):
    """bitsandbytes.matmul_4bit's portable path (the one without AVX512-BF16): the weight
    dequantized to the activations' dtype, then a dense matmul. Each packed layer holds, part by
    part, the bytes and scales bitsandbytes gives that part quantized alone (what transformers
    stores per module), and its output equals ``F.linear`` over those bytes decoded in plain
    PyTorch, bit for bit (the same elementwise products, then the same matmul)."""
    monkeypatch.setattr(F, "has_avx512bf16", lambda: False)
    dense = _layers(BnbSpec(quant_type=quant_type))
    for layer, parts in dense.items():
        state = layer.bnb_state
        assert layer.bnb_weight.dtype == torch.uint8 and not getattr(
            state, "packing_format_for_cpu", False
        )
        by_part = [F.quantize_4bit(w, blocksize=64, quant_type=quant_type) for w in parts]
        assert torch.equal(
            layer.bnb_weight.reshape(-1), torch.cat([q.reshape(-1) for q, _ in by_part])
        )
        assert torch.equal(layer.bnb_absmax, torch.cat([s.absmax for _, s in by_part]))
        w = _decode_4bit(layer.bnb_weight, layer.bnb_absmax, quant_type, state.shape)
        assert torch.equal(w, torch.cat([F.dequantize_4bit(q, s) for q, s in by_part]))
        for rows in (1, 7):
            x = torch.randn(rows, w.shape[1])
            assert torch.equal(layer(x), torch.nn.functional.linear(x, w, layer.bias))
        assert layer(torch.randn(2, 3, w.shape[1])).shape == (2, 3, w.shape[0])


@pytest.mark.skipif(
    not F.has_avx512bf16(), reason="bitsandbytes' fused CPU kernel needs AVX512-BF16"
)
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_4bit_fused_cpu_kernel_matches_the_bf16_reference(quant_type):
    """bitsandbytes' fused CPU kernel (what transformers' Linear4bit runs on this CPU): bf16
    inputs, bf16 scales, bf16 weights, partial sums and output. Against the same bf16 operands
    multiplied in fp32 by PyTorch, each value held in bf16 on the way is off by at most half a
    bf16 ulp (2^-8 of its magnitude), so the output by at most 2^-8 of the sum of the products'
    magnitudes plus 2^-8 of its own (measured: up to 0.0034 of the former)."""
    dense = _layers(BnbSpec(quant_type=quant_type))
    for layer, parts in dense.items():
        assert layer.bnb_state.packing_format_for_cpu
        by_part = [F.quantize_4bit(w, blocksize=64, quant_type=quant_type) for w in parts]
        absmax = torch.cat([s.absmax for _, s in by_part]).to(torch.bfloat16).float()
        q = torch.cat([q.reshape(-1) for q, _ in by_part])
        w = _decode_4bit(q, absmax, quant_type, (sum(p.shape[0] for p in parts), -1))
        w = w.to(torch.bfloat16).float()
        for rows in (1, 7, 33):
            x = torch.randn(rows, w.shape[1])
            xb = x.to(torch.bfloat16).float()
            want, magnitude = xb @ w.T, xb.abs() @ w.abs().T
            got = layer(x) if layer.bias is None else layer(x) - layer.bias
            assert ((got - want).abs() <= (magnitude + want.abs()) * 2**-8).all()


def _int8_reference(x, cb, scb, threshold, bias):
    """LLM.int8() in plain PyTorch: the activations, in fp16, quantized per row to int8 by their
    absolute maximum (values at or above ``threshold`` left out of it, their columns zeroed);
    int8 products summed exactly; rescaled by both rows' scales over 127^2 (bitsandbytes'
    constant); the left-out columns multiplied by the dequantized weight columns."""
    xh = x.to(torch.float16)
    outliers = xh.abs() >= threshold if threshold > 0 else torch.zeros_like(xh, dtype=torch.bool)
    cols = outliers.any(dim=0).nonzero().reshape(-1)
    kept = xh.masked_fill(outliers, 0)
    sca = kept.abs().amax(dim=1).float()
    ca = torch.round(kept * (127.0 / sca.unsqueeze(-1))).to(torch.int8)
    if x.shape[0] > 1:
        ca[:, cols] = 0
    acc = (ca.double() @ cb.double().T).float()  # exact: |sum| < 2^53
    y = acc * (sca.unsqueeze(1) * scb.unsqueeze(0)) * 6.200124e-05
    if bias is not None:
        y = y + bias
    if cols.numel():
        sub_w = cb[:, cols].float() * scb.view(-1, 1) * 7.874015718698502e-3
        y = y.addmm(x[:, cols], sub_w.t())
    return y


@pytest.mark.parametrize("threshold", [0.0, 6.0])
def test_int8_packed_layers_match_the_llm_int8_reference(threshold):
    """8-bit: each layer's int8 rows and scales are bitsandbytes' row-wise quantization of the
    16-bit weight (so a packed layer's parts keep their own rows), and its output equals the
    plain-PyTorch LLM.int8() reference bit for bit (integer sums are exact; the rescaling is the
    same fp32 operations), with and without outlier columns."""
    dense = _layers(BnbSpec(bits=8, threshold=threshold))
    for layer, parts in dense.items():
        w = torch.cat(parts)
        cb, scb, _ = F.int8_vectorwise_quant(w.to(torch.float16))
        assert torch.equal(layer.bnb_weight, cb) and torch.equal(layer.bnb_scb, scb)
        for rows in (1, 7):
            x = torch.randn(rows, w.shape[1])
            x[:, 3] = 9.0  # an outlier column when the threshold is 6
            want = _int8_reference(x, cb, scb, threshold, layer.bias)
            assert torch.equal(layer(x), want)


@pytest.fixture(scope="module")
def tiny_dense(tmp_path_factory) -> str:
    return save_tiny_llama(tmp_path_factory.mktemp("bnb") / "dense", vocab_size=256)


CASES = {
    "nf4": (
        dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32),
        BnbSpec(compute_dtype=torch.float32),
    ),
    "fp4-double-quant": (
        dict(
            load_in_4bit=True,
            bnb_4bit_quant_type="fp4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.float32,
        ),
        BnbSpec(quant_type="fp4", double_quant=True, compute_dtype=torch.float32),
    ),
    "int8": (dict(load_in_8bit=True), BnbSpec(bits=8, threshold=6.0)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_transformers_checkpoint_is_detected_and_matches_transformers_and_load_time(
    case, tiny_dense, tmp_path, monkeypatch
):
    """transformers quantizes a tiny Llama with a BitsAndBytesConfig and saves it. Loom reads
    that checkpoint with no --quantization (its quantization_config selects bitsandbytes), and:
    its packed layers give what transformers' bitsandbytes modules give on the same input, bit
    for bit; its logits equal, bit for bit, those of the dense checkpoint quantized by Loom at
    load in the same format (the same bytes); and they are close to transformers' own model's
    (4-bit: within 1e-4, the fp32 difference of the dense models; int8 rounds the activations,
    so a 1e-7 difference from the attention / norms can flip a rounding: none does here
    (measured 1e-7), on a model with 10x larger weights they cost up to 2.5% of the logits'
    scale: bound 5%, same argmax)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from tests.test_llama_parity import _loom_logits, bound_runner

    kw, spec = CASES[case]
    hf = AutoModelForCausalLM.from_pretrained(
        tiny_dense,
        quantization_config=BitsAndBytesConfig(**kw),
        device_map="cpu",
        dtype=torch.float32,
    ).eval()
    hf.save_pretrained(tmp_path / "bnb")  # before any forward: the CPU kernel repacks weights
    stored = bound_runner(ServerArgs(model=str(tmp_path / "bnb"), max_total_tokens=1024))
    assert stored[0].model_config.quant_config.name == "bitsandbytes"
    monkeypatch.setattr(BitsAndBytesQuantization, "at_load", spec)
    at_load = bound_runner(
        ServerArgs(model=tiny_dense, quantization="bitsandbytes", max_total_tokens=1024)
    )

    attn, hf_attn = stored[0].model.model.layers[1].self_attn, hf.model.layers[1].self_attn
    assert attn.qkv_proj.weight is None and attn.qkv_proj.quant_method.prequantized
    x = torch.randn(5, 64)
    with torch.inference_mode():
        want = torch.cat([hf_attn.q_proj(x), hf_attn.k_proj(x), hf_attn.v_proj(x)], dim=-1)
        assert torch.equal(attn.qkv_proj(x), want)
        assert torch.equal(attn.o_proj(x), hf_attn.o_proj(x))

    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    # --load-format layered regroups the stored tensors layer by layer: the same logits
    layered = bound_runner(
        ServerArgs(model=str(tmp_path / "bnb"), load_format="layered", max_total_tokens=1024)
    )
    for split in (None, len(ids) - 1):
        got = _loom_logits(stored, ids, split)
        assert torch.equal(got, _loom_logits(at_load, ids, split)), split
        assert torch.equal(got, _loom_logits(layered, ids, split)), split
        err, scale = (got - ref).abs().max().item(), ref.abs().max().item()
        if case == "int8":
            assert err <= 0.05 * scale and got.argmax() == ref.argmax(), (split, err, scale)
        else:
            assert err <= 1e-4, (split, err)


def test_default_model_in_nf4_keeps_hf_top1(hf_model, hf_ref_dir, engine):
    """SmolLM2 (its fp32 safetensors) with --quantization bitsandbytes (NF4 at load, blocks of
    64) against HF's dense argmax, teacher-forced on NF4's tokens. NF4 costs this 135M model a
    quarter of its greedy choices: measured 148 / 192 here, and transformers' own NF4 model
    (the same BitsAndBytesConfig) 127 / 169 against the same dense model, while HF's NF4 model
    takes Loom's NF4 tokens as its argmax 191 / 192 times. A wrong layout or scale would agree
    on almost nothing."""
    prompts = [chat_ids(engine, p) for p in CHAT_PROMPTS[:6]]
    params = {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}
    with loom.Engine(model=hf_ref_dir, max_total_tokens=4096, quantization="bitsandbytes") as e:
        layers = [m for m in e.runner.model.modules() if getattr(m, "quant_method", None)]
        assert len(layers) == 4 * e.runner.model.config.num_hidden_layers
        assert all(m.weight is None and m.bnb_weight.dtype == torch.uint8 for m in layers)
        outs = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=params)]
        e.scheduler.check_kv_balance()
    same, total = hf_top1_agreement(hf_model, prompts, outs)
    assert same / total >= 0.7, (same, total)


def test_load_format_bitsandbytes_implies_the_quantization(tiny_dense):
    from loom.model_executor.model_runner import ModelRunner

    args = ServerArgs(model=tiny_dense, load_format="bitsandbytes", max_total_tokens=256)
    runner = ModelRunner(args)
    assert runner.model_config.quant_config.name == "bitsandbytes"
    qkv = runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight is None and qkv.bnb_state.quant_type == "nf4"
    with pytest.raises(ValueError, match="--load-format bitsandbytes loads with --quantization"):
        ModelRunner(args.replace(quantization="fp8"))


def test_missing_package_is_named(tiny_dense, monkeypatch):
    """Without bitsandbytes, --quantization bitsandbytes (and a bitsandbytes checkpoint, which
    selects it) fails naming the package, before anything is built."""
    from loom.model_executor.model_runner import ModelRunner

    for module in ("bitsandbytes", "bitsandbytes.functional"):
        monkeypatch.setitem(__import__("sys").modules, module, None)
    with pytest.raises(ImportError, match="needs the bitsandbytes package"):
        ModelRunner(ServerArgs(model=tiny_dense, quantization="bitsandbytes"))
