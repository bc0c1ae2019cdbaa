"""Mistral: Llama with every layer attending within ``sliding_window`` when the config sets one
(Mistral-7B v0.1: 4,096; later releases: none)."""

from __future__ import annotations

from loom.models.decoder import DecoderForCausalLM


class MistralForCausalLM(DecoderForCausalLM):
    pass
