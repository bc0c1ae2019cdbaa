"""``--quantization gguf``: a GGUF file's linear weights kept in their blocks.

On the CPU, Q4_0, Q4_1 and Q8_0 layers keep their file's blocks (4.5 / 5 / 8.5 bits a weight
instead of 32) and are multiplied by Loom's own kernel (``cpu_blocks``: the activations in int8
blocks as llama.cpp takes them, exact int32 dot products on AVX-512 VNNI; from ``GEMM_ROWS``
rows a bf16 GEMM over the dequantised weight). Where that kernel does not run, Q4_0 and Q4_1 go
to PyTorch's CPU int4 matmul, which reads int4 with one scale and zero point per group of 32
(``w = (q - 8) * scale + zero``: Q4_1's zero is ``m + 8 d``), with bf16 inputs and scales. The
loader hands these layers each tensor's raw blocks (``[rows, blocks * bytes]``, uint8, rows
already in HF order), which the packed layers' loaders place by rows like dense ones; after
loading they are converted to the kernel's form once. Layers whose parts are stored in other
formats (the K-quants, F16, or parts of different formats) stay dense, dequantised.

On CUDA every block format of ``gguf_blocks`` (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)
is kept as the file's bytes, ``[rows, blocks * bytes]`` uint8 on the device, and multiplied by
``gguf_triton.gguf_matmul``, which decodes the blocks in the kernel (one-token decode) or
dequantizes into a temporary for cuBLAS (more rows): the device holds the file's bytes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from loom.layers.quantization import cpu_blocks
from loom.layers.quantization.base import LinearMethod, QuantizationConfig, column_cut
from loom.layers.quantization.gguf_blocks import BLOCKS, row_bytes

GROUP = 32
# block bytes by GGML type name: fp16 scale (and fp16 offset), then 16 bytes of 32 nibbles
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}


def cpu_kept() -> dict[str, int]:
    """The block formats kept packed on the CPU, with their block bytes: Loom's kernel's where
    it runs here, else PyTorch's int4 kernel's."""
    return cpu_blocks.GGUF_BYTES if cpu_blocks.available() else BLOCK_BYTES


def unpack_blocks(raw: torch.Tensor, qtype: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``raw`` ``[rows, blocks * BLOCK_BYTES]`` (uint8) as int4 values ``[rows, blocks * 32]``
    (0..15), and the per-group ``scale`` and ``zero`` ``[rows, blocks]`` (fp32) with
    ``w = (q - 8) * scale + zero``."""
    u, d, m = cpu_blocks.gguf_fields(raw, qtype)
    d = d.float()
    # u * d + m = (u - 8) * d + (m + 8 d); Q4_0's m is -8 d, so its zero is 0
    zero = m.float() + 8 * d if qtype == "Q4_1" else torch.zeros_like(d)
    return u.reshape(raw.shape[0], -1).to(torch.int32), d, zero


class GGUFLinearMethod(LinearMethod):
    def __init__(self, qtype: str) -> None:
        self.qtype = qtype

    def create_weights(self, layer: nn.Module) -> None:
        out_features, in_features = layer.weight.shape
        if layer.weight.device.type not in ("cpu", "meta"):  # (meta: loaded layer by layer)
            raise ValueError("the int4 path of --quantization gguf runs on the CPU")
        if in_features % GROUP:
            raise ValueError(f"input size {in_features} is not a multiple of {GROUP}")
        block_bytes = cpu_blocks.GGUF_BYTES[self.qtype]
        row_bytes = in_features // GROUP * block_bytes
        weight = nn.Parameter(
            torch.empty(out_features, row_bytes, dtype=torch.uint8, device=layer.weight.device),
            requires_grad=False,
        )
        weight.weight_loader = layer.weight_loader
        weight.input_columns = column_cut(GROUP, block_bytes, self.qtype)
        layer.weight = weight

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if cpu_blocks.available():
            wq, wd, wm, bits = cpu_blocks.from_gguf(layer.weight.data, self.qtype)
            for name, t in (("block_wq", wq), ("block_wd", wd), ("block_wm", wm)):
                layer.register_buffer(name, t, persistent=False)
            layer.block_bits = bits
            del layer.weight
            layer.register_parameter("weight", None)
            return
        q, scale, zero = unpack_blocks(layer.weight.data, self.qtype)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        layer.register_buffer("qweight", packed, persistent=False)
        # [groups, out, 2]: each group's scale and zero for every output row
        sz = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16)
        layer.register_buffer("scales_zeros", sz, persistent=False)
        del layer.weight
        layer.register_parameter("weight", None)

    def apply(self, layer, x, bias):
        if getattr(layer, "block_bits", None) is not None:
            y = cpu_blocks.block_mm(
                x, layer.block_wq, layer.block_wd, layer.block_wm, layer.block_bits
            )
            return y if bias is None else y + bias
        shape = x.shape
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.reshape(-1, shape[-1]).to(torch.bfloat16), layer.qweight, GROUP, layer.scales_zeros
        ).to(x.dtype)
        y = y.reshape(*shape[:-1], y.shape[-1])
        return y if bias is None else y + bias


def keeps_blocks() -> bool:
    """Whether layers keep their raw blocks for the Triton kernels: on CUDA, the device the
    model is being built on (``build_model``'s enclosing ``torch.device``)."""
    return torch.empty(0).device.type == "cuda"


class GGUFBlocksLinearMethod(LinearMethod):
    """CUDA: the layer's weight is its rows' raw GGML blocks, decoded by the Triton kernels."""

    def __init__(self, qtype: str) -> None:
        self.qtype = qtype

    def create_weights(self, layer: nn.Module) -> None:
        out_features, in_features = layer.weight.shape
        weight = nn.Parameter(
            torch.empty(
                out_features,
                row_bytes(in_features, self.qtype),
                dtype=torch.uint8,
                device=layer.weight.device,
            ),
            requires_grad=False,
        )
        weight.weight_loader = layer.weight_loader
        weight.input_columns = column_cut(*BLOCKS[self.qtype], self.qtype)
        layer.weight = weight

    def apply(self, layer, x, bias):
        from loom.layers.quantization.gguf_triton import gguf_matmul

        y = gguf_matmul(x, layer.weight, self.qtype)
        return y if bias is None else y + bias


class GGUFQuantization(QuantizationConfig):
    """``types``: each checkpoint tensor's GGML type name, by HF name."""

    name = "gguf"

    def __init__(self, types: dict[str, str]) -> None:
        self.types = types
        self._packed: set[str] = set()

    @classmethod
    def from_model(cls, model_path: str, hf_config: Any) -> GGUFQuantization:
        import gguf

        from loom.model_loader.gguf_layouts import layout_for
        from loom.model_loader.gguf_loader import GGUFLoader

        if not (model_path.endswith(".gguf") and GGUFLoader.can_load(model_path)):
            raise ValueError(f"--quantization gguf needs a .gguf file, not {model_path}")
        loader = GGUFLoader()
        layout = layout_for(loader._metadata(model_path))
        types = {}
        for t in gguf.GGUFReader(model_path).tensors:
            hf = layout.hf_name(t.name)
            if hf is not None and "{e}" not in hf:
                types[hf] = t.tensor_type.name
        return cls(types)

    def linear_method(self, prefix: str, sources: list[str]) -> LinearMethod | None:
        found = [s for s in sources if s in self.types]
        kinds = {self.types[s] for s in found}
        blocks = keeps_blocks()
        kept = BLOCKS if blocks else cpu_kept()
        if not found or len(kinds) != 1 or next(iter(kinds)) not in kept:
            return None
        self._packed.update(found)
        return GGUFBlocksLinearMethod(kinds.pop()) if blocks else GGUFLinearMethod(kinds.pop())

    def load_form(self, name: str) -> bool:
        return name in self._packed

    def apply(self, model: nn.Module) -> int:
        """The projections' methods, and on the CPU an int8 LM head when the file stores it
        (or the tied embedding) quantized: the fp32 head read 113 MB a decode step of the
        default model."""
        count = super().apply(model)
        head = getattr(model, "lm_head", None)
        tied = getattr(model, "tie_word_embeddings", False)
        source = "model.embed_tokens.weight" if tied else "lm_head.weight"
        quantized = self.types.get(source, "F32") not in ("F32", "F16", "BF16")
        if head is not None and not keeps_blocks() and quantized:
            head.int8_head = True
        return count
