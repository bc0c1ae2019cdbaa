"""The quantization family: ``--quantization gguf`` keeps Q4_0 / Q4_1 weights in their blocks.

Oracles: the ``gguf`` package's own dequantisation (the block layout), a dense matmul over the
dequantised weight (the packed matmul), and HF transformers on the same GGUF (the model)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

import loom
from loom import plugins
from loom.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from loom.layers.quantization import cpu_blocks
from loom.layers.quantization.gguf import GROUP, GGUFLinearMethod, unpack_blocks
from loom.testing import check_quantization
from tests.conftest import CHAT_PROMPTS, chat_ids, hf_top1_agreement, save_tiny_llama


def _blocks(qtype: str, rows: int, cols: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Random weights quantised by ``gguf`` into ``qtype`` blocks, and their dequantisation."""
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    kind = getattr(gguf.GGMLQuantizationType, qtype)
    raw = gguf.quants.quantize(w, kind)
    return raw, gguf.quants.dequantize(raw, kind)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_blocks_unpack_to_the_gguf_packages_values(qtype):
    raw, want = _blocks(qtype, 24, 128)
    q, scale, zero = unpack_blocks(torch.from_numpy(raw), qtype)
    assert q.shape == (24, 128) and int(q.min()) >= 0 and int(q.max()) <= 15
    got = (q.float() - 8) * scale.repeat_interleave(GROUP, 1) + zero.repeat_interleave(GROUP, 1)
    assert torch.equal(got, torch.from_numpy(want))


@pytest.mark.parametrize(
    "qtype,kernel",
    [("Q4_0", "loom"), ("Q4_1", "loom"), ("Q8_0", "loom"), ("Q4_0", "torch"), ("Q4_1", "torch")],
)
def test_packed_layers_load_shards_and_match_the_dense_matmul(qtype, kernel, monkeypatch):
    """A merged (gate/up) and a row-parallel layer given the method load their checkpoint
    tensors' raw blocks through their own loaders and multiply like the dequantised weight:
    through Loom's CPU kernel (int8 activations in blocks of 32), and through PyTorch's int4
    kernel where Loom's does not run (bf16 inputs and scales); within 1% of the output's
    scale."""
    if kernel == "torch":
        monkeypatch.setattr(cpu_blocks, "available", lambda: False)
    elif not cpu_blocks.available():
        pytest.skip(f"Loom's CPU block kernel: {cpu_blocks._build()}")
    gate, gate_w = _blocks(qtype, 96, 64, seed=1)
    up, up_w = _blocks(qtype, 96, 64, seed=2)
    down, down_w = _blocks(qtype, 64, 192, seed=3)
    merged, row = MergedColumnParallelLinear(64, [96, 96]), RowParallelLinear(192, 64)
    for layer in (merged, row):
        layer.quant_method = GGUFLinearMethod(qtype)
        layer.quant_method.create_weights(layer)
    merged.weight.weight_loader(merged.weight, torch.from_numpy(gate), 0)
    merged.weight.weight_loader(merged.weight, torch.from_numpy(up), 1)
    row.weight.weight_loader(row.weight, torch.from_numpy(down))
    x = torch.randn(5, 64)
    for layer in (merged, row):
        layer.process_weights_after_loading()
        packed = layer.block_wq if kernel == "loom" else layer.qweight
        assert layer.weight is None and packed.dtype == torch.uint8
    h = merged(x)
    want_h = x @ torch.from_numpy(np.concatenate([gate_w, up_w])).T
    assert h.dtype == torch.float32
    assert (h - want_h).abs().max() < 0.01 * want_h.abs().max()
    y = row(h)
    want_y = h @ torch.from_numpy(down_w).T
    assert (y - want_y).abs().max() < 0.01 * want_y.abs().max()


def test_default_model_kept_in_blocks_keeps_hf_top1(hf_model, engine):
    """The default model (Q4_1 GGUF) with ``--quantization gguf``: every attention and MLP
    projection held as int4 blocks (~8x smaller than fp32), and its greedy tokens against HF's
    argmax on the same file (fp32, dequantised), teacher-forced on Loom's tokens: int8
    activations in blocks of 32 (Loom's kernel), or bf16 inputs and scales and a per-row int8
    head (PyTorch's), flip near-ties only (measured over 8 prompts x 64 tokens: 507 / 512 and
    502 / 512; a wrong block layout would agree on almost nothing)."""
    prompts = [chat_ids(engine, p) for p in CHAT_PROMPTS[:6]]
    params = {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}
    with loom.Engine(max_total_tokens=4096, quantization="gguf") as e:
        model = e.runner.model
        packed = [m for m in model.modules() if getattr(m, "quant_method", None) is not None]
        assert len(packed) == 4 * model.config.num_hidden_layers
        assert all(m.weight is None for m in packed)
        if cpu_blocks.available():  # the file's Q8_0 head in its blocks
            assert model.lm_head._head_blocks[3] == 8
        else:  # as int8, one scale a row
            assert model.lm_head._head_int8[0].dtype == torch.int8
        outs = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=params)]
        e.scheduler.check_kv_balance()
    same, total = hf_top1_agreement(hf_model, prompts, outs)
    assert same / total >= 0.95, (same, total)


def test_gguf_quantization_needs_a_gguf_file(tmp_path):
    tiny = save_tiny_llama(tmp_path / "tiny", vocab_size=128)
    with pytest.raises(ValueError, match="--quantization gguf needs a .gguf file"):
        loom.Engine(model=tiny, skip_tokenizer_init=True, quantization="gguf")


@pytest.mark.parametrize("name", plugins.names("quantization"))
def test_conformance_kit(name, smol_gguf, tmp_path):
    """Each registered member through the family's kit: gguf on the default model (a GGUF), the
    others on a tiny HF Llama (fp8: E4M3 keeps 3 mantissa bits, so within 8%)."""
    if name == "gguf":
        assert check_quantization(name, smol_gguf, min_layers=4 * 30) == 4 * 30
        return
    if name == "modelopt":  # an export, against its weights dequantized (layer 1's MLP: dense)
        export, deq = _modelopt_export(tmp_path)
        assert check_quantization(name, export, rtol=1e-4, min_layers=6, reference_path=deq) == 6
        return
    path = save_tiny_llama(tmp_path / "tiny", vocab_size=256, initializer_range=0.2)
    if name == "bitsandbytes":
        # NF4: 16 levels per block of 64 weights, a weight off by up to half the gap around it
        # (0.04 to 0.15 of the block's absmax): outputs off by ~9% of their rms, the largest
        # error reaching 0.13 of the largest output (measured over 4 seeds)
        pytest.importorskip("bitsandbytes")
        assert check_quantization(name, path, rtol=0.15, min_layers=4) >= 4
        return
    assert check_quantization(name, path, rtol=0.08, min_layers=4) >= 4


def test_fp8_rows_round_trip_within_e4m3_precision():
    from loom.layers.quantization.fp8 import FP8, quantize_rows

    w = torch.randn(48, 64) * torch.logspace(-3, 2, 48).unsqueeze(1)  # rows of any magnitude
    q, scale = quantize_rows(w)
    assert q.dtype == FP8 and scale.shape == (48,)
    back = q.float() * scale.unsqueeze(1)
    # E4M3: 3 mantissa bits, half an ulp of relative error (2^-4) above the subnormals
    big = w.abs() > scale.unsqueeze(1) * 2**-6
    assert ((back - w).abs() <= w.abs() * 2**-4 + 1e-12)[big].all()
    assert (q.float().abs().amax(dim=1) == 448).all()  # each row's largest value at the top


def test_fp8_model_keeps_hf_top1(hf_model, hf_ref_dir, engine):
    """SmolLM2 (its fp32 safetensors, as HF loads the GGUF) with --quantization fp8 against HF's
    argmax on the same weights, teacher-forced on fp8's tokens: per-channel E4M3 weights flip
    near-ties only (a wrong scale or layout would agree on almost nothing)."""
    prompts = [chat_ids(engine, p) for p in CHAT_PROMPTS[:6]]
    params = {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}
    with loom.Engine(model=hf_ref_dir, max_total_tokens=4096, quantization="fp8") as e:
        assert all(
            m.weight is None and m.weight_fp8.dtype == torch.float8_e4m3fn
            for m in e.runner.model.modules()
            if getattr(m, "quant_method", None) is not None
        )
        outs = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=params)]
        e.scheduler.check_kv_balance()
    same, total = hf_top1_agreement(hf_model, prompts, outs)
    assert same / total >= 0.9, (same, total)


def _fp8_checkpoint(tmp_path, scheme: str) -> tuple[str, str]:
    """A tiny Llama as an FP8 checkpoint (per-tensor E4M3 ``weight`` and fp32 ``weight_scale``
    for every projection, ``input_scale`` with the static scheme: AutoFP8's format), and the same
    weights dequantized as a plain checkpoint (the oracle's)."""
    import json

    from safetensors.torch import load_file, save_file

    from loom.layers.quantization.fp8 import FP8, FP8_MAX

    dense = save_tiny_llama(tmp_path / "dense", vocab_size=256, initializer_range=0.2)
    state = load_file(f"{dense}/model.safetensors")
    fp8, deq = {}, {}
    for name, w in state.items():
        if name.endswith("_proj.weight"):
            scale = w.abs().max().float() / FP8_MAX
            q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
            fp8[name], fp8[name + "_scale"] = q, scale.reshape(())
            if scheme == "static":
                fp8[name.removesuffix("weight") + "input_scale"] = torch.tensor(0.05)
            deq[name] = q.float() * scale
        else:
            fp8[name] = deq[name] = w
    config = json.loads(open(f"{dense}/config.json").read())
    for kind, tensors in (("fp8", fp8), ("deq", deq)):
        out = tmp_path / kind
        out.mkdir()
        save_file(tensors, out / "model.safetensors")
        cfg = dict(config)
        if kind == "fp8":
            cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": scheme}
        (out / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path / "fp8"), str(tmp_path / "deq")


@pytest.mark.parametrize("scheme", ["dynamic", "static"])
def test_fp8_checkpoint_is_detected_and_read_as_stored(tmp_path, scheme):
    """An FP8 checkpoint selects --quantization fp8 by itself; its E4M3 rows and per-part
    scales give (on the CPU's dequantizing path, fp32) the logits HF computes from the same
    weights dequantized, over extend and decode."""
    from transformers import AutoModelForCausalLM

    from loom.config import ServerArgs
    from tests.test_llama_parity import _loom_logits, bound_runner

    fp8_dir, deq_dir = _fp8_checkpoint(tmp_path, scheme)
    runner, cache = bound_runner(ServerArgs(model=fp8_dir, max_total_tokens=1024))
    assert runner.model_config.quant_config.name == "fp8"
    qkv = runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight is None and qkv.weight_fp8.dtype == torch.float8_e4m3fn
    # q, k and v keep their own scales, row by row
    assert len(set(qkv.weight_scale.tolist())) == 3
    hf = AutoModelForCausalLM.from_pretrained(deq_dir).eval()
    ids = torch.randint(0, 256, (40,)).tolist()
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    for split in (None, len(ids) - 1, 25):
        got = _loom_logits((runner, cache), ids, split)
        assert (got - ref).abs().max().item() < 1e-4, split


def test_a_checkpoint_quantized_another_way_is_refused_by_name(tmp_path):
    import json

    path = save_tiny_llama(tmp_path / "awq", vocab_size=256)
    cfg = json.loads(open(f"{path}/config.json").read())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4}
    open(f"{path}/config.json", "w").write(json.dumps(cfg))
    with pytest.raises(ValueError, match="quantized with 'awq', which Loom does not read"):
        loom.Engine(model=path, skip_tokenizer_init=True, max_total_tokens=256)


def _modelopt_export(tmp_path) -> tuple[str, str]:
    """A tiny Llama as a ModelOpt FP8 export (hf_quant_config.json; E4M3 weights with per-tensor
    weight and input scales; KV scales on k_proj / v_proj; the second layer's MLP excluded, so
    stored dense), and the same weights dequantized as a plain checkpoint."""
    import json

    from safetensors.torch import load_file, save_file

    from loom.layers.quantization.fp8 import FP8, FP8_MAX

    dense = save_tiny_llama(tmp_path / "dense", vocab_size=256, initializer_range=0.2)
    state = load_file(f"{dense}/model.safetensors")
    export, deq = {}, {}
    for name, w in state.items():
        if name.endswith("_proj.weight") and ".layers.1.mlp." not in name:
            scale = w.abs().max().float() / FP8_MAX
            q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
            stem = name.removesuffix("weight")
            export[name], export[stem + "weight_scale"] = q, scale.reshape(())
            export[stem + "input_scale"] = torch.tensor(0.02)
            deq[name] = q.float() * scale
        else:
            export[name] = deq[name] = w
        if name.endswith("k_proj.weight") or name.endswith("v_proj.weight"):
            kv = "k_scale" if ".k_proj." in name else "v_scale"
            export[name.removesuffix("weight") + kv] = torch.tensor(1.0)
    config = open(f"{dense}/config.json").read()
    for kind, tensors in (("export", export), ("deq", deq)):
        (tmp_path / kind).mkdir()
        save_file(tensors, tmp_path / kind / "model.safetensors")
        (tmp_path / kind / "config.json").write_text(config)
    (tmp_path / "export" / "hf_quant_config.json").write_text(
        json.dumps(
            {
                "producer": {"name": "modelopt", "version": "0.27.0"},
                "quantization": {
                    "quant_algo": "FP8",
                    "kv_cache_quant_algo": "FP8",
                    "exclude_modules": ["lm_head", "model.layers.1.mlp*"],
                },
            }
        )
    )
    return str(tmp_path / "export"), str(tmp_path / "deq")


def test_modelopt_fp8_export_is_detected_and_read(tmp_path):
    """A ModelOpt FP8 export is read as ``modelopt`` by itself (excluded modules dense, KV
    scales loaded) and gives HF's logits on the same weights dequantized."""
    from transformers import AutoModelForCausalLM

    from loom.config import ServerArgs
    from tests.test_llama_parity import _loom_logits, bound_runner

    export, deq = _modelopt_export(tmp_path)
    runner, cache = bound_runner(ServerArgs(model=export, max_total_tokens=1024))
    assert runner.model_config.quant_config.name == "modelopt"
    layers = runner.model.model.layers
    assert layers[0].mlp.down_proj.quant_method is not None
    assert layers[1].mlp.down_proj.quant_method is None  # excluded: dense
    assert float(layers[0].self_attn.qkv_proj.k_scale) == 1.0
    hf = AutoModelForCausalLM.from_pretrained(deq).eval()
    ids = torch.randint(0, 256, (40,)).tolist()
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    for split in (None, len(ids) - 1):
        got = _loom_logits((runner, cache), ids, split)
        assert (got - ref).abs().max().item() < 1e-4, split


def test_modelopt_refuses_other_algorithms(tmp_path):
    import json

    export, _ = _modelopt_export(tmp_path)
    path = f"{export}/hf_quant_config.json"
    cfg = json.loads(open(path).read())
    cfg["quantization"]["quant_algo"] = "NVFP4"
    open(path, "w").write(json.dumps(cfg))
    with pytest.raises(ValueError, match="ModelOpt quant_algo 'NVFP4' is not read"):
        loom.Engine(model=export, skip_tokenizer_init=True, max_total_tokens=256)
