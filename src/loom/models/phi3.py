"""Phi-3 (and Phi-3.5, Phi-4-mini): Llama whose checkpoints store qkv_proj and gate_up_proj
fused; partial rotary and longrope scaling come from the config."""

from __future__ import annotations

from loom.models.decoder import DecoderForCausalLM, DecoderSpec


class Phi3ForCausalLM(DecoderForCausalLM):
    spec = DecoderSpec(fused_checkpoint=True)
