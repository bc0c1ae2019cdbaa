"""Gemma 2 and Gemma 3 (text): norms scaling by (1 + w) before and after attention and the MLP,
embeddings scaled by sqrt(hidden_size), GeGLU (tanh GELU), the query scaled by
``query_pre_attn_scalar``, layers alternating sliding-window and global attention (Gemma 3: with
their own rotary bases); Gemma 2 soft-caps attention and final logits, Gemma 3 normalises q and k
per head instead."""

from __future__ import annotations

from loom.models.decoder import DecoderForCausalLM, DecoderSpec


class Gemma2ForCausalLM(DecoderForCausalLM):
    spec = DecoderSpec(gemma=True)


class Gemma3ForCausalLM(DecoderForCausalLM):
    spec = DecoderSpec(gemma=True, qk_norm=True)
