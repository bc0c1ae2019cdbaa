"""Conformance kit of the quantization family: every layer a member quantizes computes what the
same layer of the dense model computes, from the same checkpoint."""

from __future__ import annotations

import torch

from loom import plugins


def check_quantization(
    name: str,
    model_path: str,
    rtol: float = 0.02,
    min_layers: int = 1,
    device: str = "cpu",
    dtype: str = "float32",
    reference_path: str | None = None,
) -> int:
    """Build ``model_path`` with ``--quantization name`` and, dense, ``reference_path`` (default
    ``model_path``; for a checkpoint that is stored quantized, the same weights dequantized), on
    ``device`` in ``dtype``, and check:
    at least ``min_layers`` linear layers took the member's method; each one's dense ``weight``
    is gone (the method's own parameters replaced it); on random inputs of 1 and 7 tokens (and
    a 3-D batch) its output has the input's dtype and shape and is within ``rtol`` of the
    output's largest magnitude from the dense layer. Returns how many layers were checked."""
    from loom.config import ServerArgs
    from loom.layers.linear import LinearBase
    from loom.model_executor.model_runner import ModelRunner

    assert name in plugins.names("quantization"), f"{name!r} is not a registered quantization"
    kw = dict(dtype=dtype, device=device, max_total_tokens=256, disable_cuda_graph=True)
    dense_args = ServerArgs(model=reference_path or model_path, **kw)
    dense = dict(ModelRunner(dense_args).model.named_modules())
    quantized = ModelRunner(ServerArgs(model=model_path, quantization=name, **kw)).model
    gen = torch.Generator().manual_seed(0)
    checked = 0
    for prefix, layer in quantized.named_modules():
        if not isinstance(layer, LinearBase) or layer.quant_method is None:
            continue
        ref = dense[prefix]
        assert layer.weight is None or layer.weight.shape != ref.weight.shape, (
            f"{prefix}: the method left a dense weight of the layer's shape"
        )
        in_features = ref.weight.shape[1]
        for shape in ((1, in_features), (7, in_features), (2, 3, in_features)):
            x = torch.randn(*shape, generator=gen).to(
                device=ref.weight.device, dtype=ref.weight.dtype
            )
            with torch.inference_mode():
                got, want = layer(x), ref(x)
            assert got.dtype == x.dtype and got.shape == want.shape, (
                f"{prefix}: output {got.dtype} {tuple(got.shape)}, want {x.dtype} "
                f"{tuple(want.shape)}"
            )
            err = (got - want).abs().max().item()
            assert err <= rtol * want.abs().max().item(), (
                f"{prefix}: off the dense layer by {err:.4g} (scale {want.abs().max().item():.4g})"
            )
        checked += 1
    assert checked >= min_layers, f"{name}: {checked} layers quantized, want >= {min_layers}"
    return checked
