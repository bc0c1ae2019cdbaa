"""Llama (and Llama-shaped models: SmolLM2, Llama-3, TinyLlama, ...): the shared decoder as it
is (models/decoder.py)."""

from __future__ import annotations

from loom.models.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    pass
