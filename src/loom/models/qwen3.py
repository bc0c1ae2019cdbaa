"""Qwen3: Llama with an RMSNorm over each head of q and k before the rotary embedding."""

from __future__ import annotations

from loom.models.decoder import DecoderForCausalLM, DecoderSpec


class Qwen3ForCausalLM(DecoderForCausalLM):
    spec = DecoderSpec(qk_norm=True)
