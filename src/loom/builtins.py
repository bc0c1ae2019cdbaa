"""Loom's own members of each plug-in family: a table ``plugins`` reads and registers lazily
(a member's module is imported only when it is resolved)."""

from __future__ import annotations

BUILTINS: dict[str, dict[str, str]] = {
    "model": {
        "LlamaForCausalLM": "loom.models.llama:LlamaForCausalLM",
        "MistralForCausalLM": "loom.models.mistral:MistralForCausalLM",
        "Qwen2ForCausalLM": "loom.models.qwen2:Qwen2ForCausalLM",
        "Qwen3ForCausalLM": "loom.models.qwen3:Qwen3ForCausalLM",
        "Phi3ForCausalLM": "loom.models.phi3:Phi3ForCausalLM",
        "Gemma2ForCausalLM": "loom.models.gemma:Gemma2ForCausalLM",
        "Gemma3ForCausalLM": "loom.models.gemma:Gemma3ForCausalLM",
        "MixtralForCausalLM": "loom.models.mixtral:MixtralForCausalLM",
        "Qwen2MoeForCausalLM": "loom.models.qwen_moe:Qwen2MoeForCausalLM",
        "Qwen3MoeForCausalLM": "loom.models.qwen_moe:Qwen3MoeForCausalLM",
    },
    "attention_backend": {
        "torch_native": "loom.layers.attention.torch_native:TorchNativeAttnBackend",
        "cpu": "loom.layers.attention.cpu_backend:CPUAttnBackend",
        "triton": "loom.layers.attention.triton_backend:TritonAttnBackend",
        "flash_attention": "loom.layers.attention.flash_attention_backend:FlashAttentionBackend",
        "flashinfer": "loom.layers.attention.flashinfer_backend:FlashInferAttnBackend",
    },
    "grammar_backend": {
        "xgrammar": "loom.constrained.xgrammar_backend:XGrammarBackend",
        "llguidance": "loom.constrained.llguidance_backend:LLGuidanceBackend",
        "reasoner": "loom.constrained.reasoner:ReasonerBackend",
        "none": "loom.constrained.manager:NoGrammarBackend",
    },
    "model_loader": {
        "auto": "loom.model_loader.loaders:AutoLoader",
        "safetensors": "loom.model_loader.loaders:SafetensorsLoader",
        "bitsandbytes": "loom.model_loader.loaders:BitsAndBytesLoader",
        "pt": "loom.model_loader.loaders:PtLoader",
        "gguf": "loom.model_loader.gguf_loader:GGUFLoader",
        "dummy": "loom.model_loader.loaders:DummyLoader",
        "layered": "loom.model_loader.layered:LayeredLoader",
    },
    "quantization": {
        "fp8": "loom.layers.quantization.fp8:Fp8Quantization",
        "gguf": "loom.layers.quantization.gguf:GGUFQuantization",
        "modelopt": "loom.layers.quantization.modelopt:ModelOptQuantization",
        "bitsandbytes": "loom.layers.quantization.bitsandbytes:BitsAndBytesQuantization",
    },
    "radix_eviction_policy": {
        "lru": "loom.mem_cache.eviction:LRUPolicy",
        "lfu": "loom.mem_cache.eviction:LFUPolicy",
        "fifo": "loom.mem_cache.eviction:FIFOPolicy",
        "mru": "loom.mem_cache.eviction:MRUPolicy",
        "filo": "loom.mem_cache.eviction:FILOPolicy",
        "priority": "loom.mem_cache.eviction:PriorityPolicy",
        "slru": "loom.mem_cache.eviction:SLRUPolicy",
    },
    "lora_backend": {
        "auto": "loom.lora.backends:AutoLoRABackend",
        "torch_native": "loom.lora.backends:TorchNativeLoRABackend",
        "triton": "loom.lora.backends:TritonLoRABackend",
    },
    "lora_eviction_policy": {
        "lru": "loom.lora.eviction:LRUPolicy",
        "lfu": "loom.lora.eviction:LFUPolicy",
        "fifo": "loom.lora.eviction:FIFOPolicy",
    },
    "schedule_policy": {
        "fcfs": "loom.scheduler.policy:FCFSPolicy",
        "lpm": "loom.scheduler.policy:LPMPolicy",
        "dfs-weight": "loom.scheduler.policy:DFSWeightPolicy",
        "lof": "loom.scheduler.policy:LOFPolicy",
        "random": "loom.scheduler.policy:RandomPolicy",
        "priority": "loom.scheduler.policy:PriorityPolicy",
    },
    "hicache_storage": {
        "file": "loom.mem_cache.storage:FileStorage",
        "sqlite": "loom.mem_cache.storage:SQLiteStorage",
    },
    "logits_processor": {
        "disallowed_tokens": "loom.sampling.logits_processor:DisallowedTokensProcessor",
        "thinking_budget": "loom.sampling.logits_processor:ThinkingBudgetProcessor",
        "no_repeat_ngram": "loom.sampling.logits_processor:NoRepeatNGramProcessor",
    },
    "tool_call_parser": {
        "hermes": "loom.function_call.formats:HermesParser",
        "llama3": "loom.function_call.formats:Llama3Parser",
        "mistral": "loom.function_call.formats:MistralParser",
        "pythonic": "loom.function_call.pythonic:PythonicParser",
        # SGLang's names for the hermes format of Qwen2.5 / Qwen3
        "qwen": "loom.function_call.formats:HermesParser",
        "qwen25": "loom.function_call.formats:HermesParser",
    },
}

# Optional modules a built-in needs; `loom plugins` reports whether they are importable.
REQUIRES: dict[tuple[str, str], tuple[str, ...]] = {
    ("model_loader", "gguf"): ("gguf",),
    ("quantization", "gguf"): ("gguf",),
    ("quantization", "bitsandbytes"): ("bitsandbytes",),
    ("model_loader", "bitsandbytes"): ("bitsandbytes",),
    ("attention_backend", "triton"): ("triton",),
    ("attention_backend", "flash_attention"): ("triton",),
    ("attention_backend", "flashinfer"): ("flashinfer",),
    ("lora_backend", "triton"): ("triton",),
    ("grammar_backend", "xgrammar"): ("xgrammar",),
    ("grammar_backend", "llguidance"): ("llguidance",),
}
