"""Qwen2 and Qwen2.5: Llama with a bias on the q, k and v projections (none on o_proj), and
sliding windows on the layers its config's ``layer_types`` mark."""

from __future__ import annotations

from loom.models.decoder import DecoderForCausalLM, DecoderSpec


class Qwen2ForCausalLM(DecoderForCausalLM):
    spec = DecoderSpec(qkv_bias=True)
