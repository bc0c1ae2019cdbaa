"""``--quantization bitsandbytes``: linear weights in bitsandbytes' 4-bit (NF4 / FP4) or 8-bit
(LLM.int8()) formats, multiplied by the ``bitsandbytes`` package's own kernels (its CPU backend on
the CPU).

Which format: a checkpoint whose ``quantization_config`` has ``quant_method`` "bitsandbytes"
(what transformers' ``save_pretrained`` writes for a model loaded with a ``BitsAndBytesConfig``)
selects this method by itself and is read as stored: ``load_in_4bit`` with
``bnb_4bit_quant_type`` nf4 / fp4 (and ``bnb_4bit_use_double_quant``, ``bnb_4bit_compute_dtype``),
or ``load_in_8bit`` (``llm_int8_threshold``). A layer is quantized when the checkpoint stores its
tensors quantized (``*.weight.absmax``, ``*.SCB``); the rest (``llm_int8_skip_modules``, the LM
head) load dense. A dense checkpoint is quantized at load to 4-bit NF4, blocks of 64, no double
quantization (vLLM and SGLang quantize in flight to 4-bit too).

4-bit: the weight ``[out, in]``, flattened row-major, is cut into blocks of 64 values, each stored
as 4-bit codes (two a byte) and a scale ``absmax``. With ``in`` a multiple of the block size
(required) every row holds whole blocks, so a weight is ``[out, in / 2]`` bytes and
``[out, in / 64]`` scales, rows the packed layers' loaders place per part (q / k / v, gate / up)
like dense rows: a packed layer holds exactly the bytes its parts were stored or quantized with,
part by part. Double quantization (absmax itself 8-bit in blocks of 256 with an offset) is read,
and resolved once to the fp32 scales bitsandbytes' kernels compute from it at every call: the
layer keeps 4.5 bits a weight instead of ~4.13.

The matmul: on a CPU with AVX512-BF16, bitsandbytes' fused 4-bit kernel (the weight repacked for
it once after loading; bf16 inputs, scales and outputs; the path transformers' ``Linear4bit``
takes there); elsewhere ``bitsandbytes.matmul_4bit`` (on the CPU: the weight dequantized to the
activations' dtype, then a dense matmul). 8-bit: the activations are quantized per row to int8
from fp16, multiplied by the int8 weight (``int8_scaled_mm``) and rescaled; with a threshold,
input columns holding a value of that magnitude are multiplied by the dequantized weight columns
in the activations' dtype instead (LLM.int8()'s outliers: a data-dependent gather, which CUDA
graphs cannot capture).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from loom.layers.quantization.base import LinearMethod, QuantizationConfig, column_cut
from loom.layers.quantization.fp8 import shard_rows

BLOCKSIZE = 64
# 4-bit statistics transformers stores next to ``X.weight`` as ``X.weight.<name>``
STATS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")


def import_bitsandbytes():
    """``bitsandbytes.functional``, or an ImportError naming the package."""
    try:
        import bitsandbytes.functional as bnb_functional
    except ImportError as e:
        raise ImportError(
            f"--quantization bitsandbytes needs the bitsandbytes package (pip install "
            f"'bitsandbytes>=0.50'), which cannot be imported: {e}"
        ) from e
    return bnb_functional


@dataclass(frozen=True)
class BnbSpec:
    bits: int = 4  # 4 or 8
    quant_type: str = "nf4"  # 4-bit codes: nf4 or fp4
    double_quant: bool = False  # 4-bit, at load: absmax quantized as bnb does, then resolved
    blocksize: int = BLOCKSIZE
    compute_dtype: torch.dtype | None = None  # 4-bit matmul dtype (None: the activations')
    threshold: float = 0.0  # 8-bit: inputs of this magnitude go through the 16-bit path


def resolve_absmax(F: Any, state: Any) -> torch.Tensor:
    """A 4-bit QuantState's per-block scales as fp32 (its nested 8-bit scales dequantized the way
    bitsandbytes' matmuls do)."""
    if state.nested:
        return (F.dequantize_blockwise(state.absmax, state.state2) + state.offset).float()
    return state.absmax.float()


class BitsAndBytesLinearMethod(LinearMethod):
    """One layer: with ``prequantized``, the checkpoint's quantized tensors load as stored;
    otherwise the dense weight loads and is quantized (part by part) after loading."""

    def __init__(self, spec: BnbSpec, prequantized: bool = False) -> None:
        self.spec = spec
        self.prequantized = prequantized
        # bitsandbytes' int8 matmul invalidates a CUDA graph capture (H200, bitsandbytes
        # 0.50.2: tests/gpu/test_cuda_bitsandbytes.py); its 4-bit kernels capture
        self.cuda_graph_safe = spec.bits != 8

    def create_weights(self, layer: nn.Module) -> None:
        out_features, in_features = layer.weight.shape
        s, device = self.spec, layer.weight.device
        if s.bits == 4 and in_features % s.blocksize:
            share = (
                f" (this rank's share of {layer.input_size} under --tp-size {layer.tp_size})"
                if in_features != layer.input_size
                else ""
            )
            raise ValueError(
                f"bitsandbytes 4-bit: input size {in_features}{share} is not a multiple of the "
                f"block size {s.blocksize}"
            )
        if not self.prequantized:
            return  # the dense weight receives the checkpoint; it is quantized after loading
        # name -> (shape, dtype, the columns of a block of ``blocksize`` inputs; None: the
        # columns are the inputs, or there is one value a row, whole on every rank)
        if s.bits == 4:
            what = f"bitsandbytes {s.quant_type}"
            shapes = {
                "weight": ((out_features, in_features // 2), torch.uint8, s.blocksize // 2),
                "weight_absmax": ((out_features, in_features // s.blocksize), torch.float32, 1),
            }
        else:
            what = "bitsandbytes int8"
            shapes = {
                "weight": ((out_features, in_features), torch.int8, None),
                "SCB": ((out_features,), torch.float32, None),
            }
        for name, (shape, dtype, columns) in shapes.items():
            param = nn.Parameter(
                torch.empty(shape, dtype=dtype, device=device), requires_grad=False
            )
            param.weight_loader = layer.weight_loader
            if columns is not None:
                param.input_columns = column_cut(s.blocksize, columns, what)
            setattr(layer, name, param)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        import bitsandbytes

        F = import_bitsandbytes()
        self._functional, self._matmul_4bit = F, bitsandbytes.matmul_4bit
        s = self.spec
        w = layer.weight.data
        out_features = w.shape[0]
        in_features = w.shape[1] * 2 if self.prequantized and s.bits == 4 else w.shape[1]
        if s.bits == 8:
            if self.prequantized:
                cb, scb = w, layer.SCB.data
            else:  # bitsandbytes quantizes a 16-bit copy of the weight, row by row
                cb, scb, _ = F.int8_vectorwise_quant(w.to(torch.float16))
            layer.register_buffer("bnb_weight", cb, persistent=False)
            layer.register_buffer("bnb_scb", scb.float(), persistent=False)
        else:
            if self.prequantized:
                q, absmax = w, layer.weight_absmax.data
            else:
                qs, scales = [], []
                for _, first, rows in shard_rows(layer):
                    part, state = F.quantize_4bit(
                        w[first : first + rows].contiguous(),
                        blocksize=s.blocksize,
                        compress_statistics=s.double_quant,
                        quant_type=s.quant_type,
                    )
                    qs.append(part.reshape(rows, -1))
                    scales.append(resolve_absmax(F, state).reshape(rows, -1))
                q, absmax = torch.cat(qs), torch.cat(scales)
            self._set_4bit(F, layer, q, absmax, out_features, in_features)
        for name in ("weight", "weight_absmax", "SCB"):
            if name in layer._parameters:
                del layer._parameters[name]
        layer.register_parameter("weight", None)

    def _set_4bit(self, F, layer, q, absmax, out_features: int, in_features: int) -> None:
        s = self.spec
        state = F.QuantState(
            absmax=absmax.reshape(-1).contiguous(),
            shape=torch.Size([out_features, in_features]),
            code=F.get_4bit_type(s.quant_type, device=q.device),
            blocksize=s.blocksize,
            quant_type=s.quant_type,
            dtype=s.compute_dtype or torch.float32,
        )
        q = q.reshape(-1, 1).contiguous()
        # bitsandbytes' fused CPU kernel: AVX512-BF16 only, rows in tiles of 32
        if q.device.type == "cpu" and F.has_avx512bf16() and out_features % 32 == 0:
            q, state = F._convert_weight_packed_for_cpu(q, state)
        layer.register_buffer("bnb_weight", q, persistent=False)
        layer.register_buffer("bnb_absmax", state.absmax, persistent=False)
        layer.bnb_state = state  # reads the buffers above (the same tensors)

    def apply(self, layer, x, bias):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        out_features = (
            layer.bnb_weight.shape[0] if self.spec.bits == 8 else layer.bnb_state.shape[0]
        )
        if x2.shape[0] == 0:
            return x.new_empty(*shape[:-1], out_features)
        if self.spec.bits == 8:
            y = self._int8(x2, layer, bias)
        else:
            dtype = self.spec.compute_dtype or x.dtype
            y = self._matmul_4bit(
                x2.to(dtype),
                layer.bnb_weight,
                layer.bnb_state,
                bias=None if bias is None else bias.to(dtype),
            )
        return y.to(x.dtype).reshape(*shape[:-1], out_features)

    def _int8(self, x2: torch.Tensor, layer: nn.Module, bias: torch.Tensor | None) -> torch.Tensor:
        # the ops bitsandbytes.matmul runs for an int8 weight (MatMul8bitLt's inference path),
        # called directly: it logs a warning on every non-fp16 call
        ops = torch.ops.bitsandbytes
        ca, sca, outliers = self._functional.int8_vectorwise_quant(
            x2.to(torch.float16), self.spec.threshold
        )
        if bias is not None:
            bias = bias.to(x2.dtype)
        if self.spec.threshold > 0.0:
            y, _ = ops.int8_mixed_scaled_mm(
                x2, ca, layer.bnb_weight, sca, layer.bnb_scb, outliers, bias
            )
            return y
        return ops.int8_scaled_mm.default(
            ca, layer.bnb_weight, sca, layer.bnb_scb, bias=bias, dtype=x2.dtype
        )


def _checkpoint_config(hf_config: Any) -> dict:
    qc = getattr(hf_config, "quantization_config", None)
    if not qc:
        return {}
    return qc if isinstance(qc, dict) else qc.to_dict()


def _dtype(name: Any) -> torch.dtype | None:
    if name is None or isinstance(name, torch.dtype):
        return name
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"bnb_4bit_compute_dtype {name!r} is not a torch dtype")
    return dtype


def _tensor_names(model_path: str) -> set[str]:
    from safetensors import safe_open

    files = sorted(f for f in os.listdir(model_path) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"{model_path}: bitsandbytes checkpoints are read from *.safetensors")
    names: set[str] = set()
    for file in files:
        with safe_open(os.path.join(model_path, file), framework="pt") as f:
            names.update(f.keys())
    return names


class BitsAndBytesQuantization(QuantizationConfig):
    """``spec``: the format; ``names``: a pre-quantized checkpoint's tensor names (None: the
    checkpoint is dense and every linear layer is quantized at load)."""

    name = "bitsandbytes"
    # the format a dense checkpoint is quantized to at load
    at_load = BnbSpec()

    def __init__(self, spec: BnbSpec, names: set[str] | None = None) -> None:
        self.spec = spec
        self.names = names
        stat = ".weight.absmax" if spec.bits == 4 else ".SCB"
        # "X.weight" of each layer the checkpoint stores quantized
        self.quantized = {n.removesuffix(stat) + ".weight" for n in names or () if n.endswith(stat)}

    @classmethod
    def detects(cls, model_path: str, hf_config: Any) -> bool:
        return _checkpoint_config(hf_config).get("quant_method") == "bitsandbytes"

    @classmethod
    def from_model(cls, model_path: str, hf_config: Any) -> BitsAndBytesQuantization:
        import_bitsandbytes()
        qc = _checkpoint_config(hf_config)
        if not qc:
            return cls(cls.at_load)
        if qc.get("quant_method") != "bitsandbytes":
            raise ValueError(
                f"--quantization bitsandbytes reads bitsandbytes checkpoints or quantizes dense "
                f"ones; {model_path} is quantized with {qc.get('quant_method')!r}"
            )
        if qc.get("load_in_4bit") or qc.get("_load_in_4bit"):
            quant_type = qc.get("bnb_4bit_quant_type", "nf4")
            if quant_type not in ("nf4", "fp4"):
                raise ValueError(f"{model_path}: bnb_4bit_quant_type {quant_type!r} (nf4 or fp4)")
            spec = BnbSpec(
                bits=4,
                quant_type=quant_type,
                double_quant=bool(qc.get("bnb_4bit_use_double_quant")),
                compute_dtype=_dtype(qc.get("bnb_4bit_compute_dtype")),
            )
        elif qc.get("load_in_8bit") or qc.get("_load_in_8bit"):
            spec = BnbSpec(bits=8, threshold=float(qc.get("llm_int8_threshold", 6.0)))
        else:
            raise ValueError(f"{model_path}: a bitsandbytes config with neither 4 nor 8 bits")
        return cls(spec, _tensor_names(model_path))

    def linear_method(self, prefix: str, sources: list[str]) -> LinearMethod | None:
        if self.names is None:
            return BitsAndBytesLinearMethod(self.spec)
        stored = [s in self.quantized for s in sources if s in self.names]
        if not any(stored):
            return None  # stored dense (llm_int8_skip_modules, or not a linear layer of bnb's)
        if not all(stored):
            raise ValueError(f"{prefix}: its parts {sources} are stored part quantized, part dense")
        return BitsAndBytesLinearMethod(self.spec, prequantized=True)

    def apply(self, model: nn.Module) -> int:
        count = super().apply(model)
        if self.names is not None and self.quantized and count == 0:
            raise ValueError(
                f"{type(model).__name__} has no Loom linear layers to read the bitsandbytes "
                "checkpoint into (--model-impl loom reads them)"
            )
        return count

    def checkpoint_tensors(self, weights):
        """A 4-bit layer's checkpoint tensors (``X.weight`` packed flat, ``X.weight.absmax``...)
        become ``X.weight`` ``[out, in / 2]`` bytes and ``X.weight_absmax`` ``[out, in / block]``
        fp32 scales once all of them have arrived; an 8-bit layer's ``weight_format`` (row-major,
        the only one written) is dropped."""
        if self.names is None:
            yield from weights
            return
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in weights:
            if self.spec.bits == 8:
                if name.endswith(".weight_format"):
                    if int(tensor.reshape(-1)[0]) != 0:
                        raise ValueError(f"{name}: only the row-major int8 format is read")
                    continue
                if name in self.quantized and tensor.dtype != torch.int8:
                    raise ValueError(f"{name}: {tensor.dtype}, an 8-bit checkpoint stores int8")
                yield name, tensor
                continue
            stem, dot, stat = name.partition(".weight.")
            key = stem + ".weight" if dot else name
            if key not in self.quantized:
                yield name, tensor
                continue
            group = pending.setdefault(key, {})
            group[stat if dot else "weight"] = tensor
            if self._complete(group):
                yield from self._rows(key, pending.pop(key))
        if pending:
            raise ValueError(f"bitsandbytes tensors missing for {sorted(pending)[:4]}")

    @staticmethod
    def _complete(group: dict[str, torch.Tensor]) -> bool:
        state = [k for k in group if k.startswith("quant_state.")]
        if not state or not {"weight", "absmax", "quant_map"} <= group.keys():
            return False
        meta = json.loads(bytes(group[state[0]].tolist()).decode())
        return "nested_offset" not in meta or {"nested_absmax", "nested_quant_map"} <= group.keys()

    def _rows(self, key: str, group: dict[str, torch.Tensor]):
        F = import_bitsandbytes()
        weight = group.pop("weight")
        state = F.QuantState.from_dict(group, device=torch.device("cpu"))
        out_features, in_features = state.shape
        s = self.spec
        if state.quant_type != s.quant_type or state.blocksize != s.blocksize:
            raise ValueError(
                f"{key}: {state.quant_type} in blocks of {state.blocksize}, the config says "
                f"{s.quant_type} in blocks of {s.blocksize}"
            )
        if in_features % s.blocksize:
            raise ValueError(f"{key}: input size {in_features} is not a multiple of {s.blocksize}")
        if weight.dtype != torch.uint8:  # bnb_4bit_quant_storage: the same bytes in another dtype
            weight = weight.contiguous().view(torch.uint8)
        absmax = resolve_absmax(F, state)
        yield key, weight.reshape(out_features, in_features // 2)
        yield key + "_absmax", absmax.reshape(out_features, in_features // s.blocksize)
