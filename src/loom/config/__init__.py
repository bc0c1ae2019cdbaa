"""Server arguments: ``ServerArgs`` is composed of frozen sections (model, cache, scheduler,
sampling, LoRA, grammar, kernels, HTTP), each handed to the component it configures. Defaults
live only here, with the device-dependent ones (``DEVICE_DEFAULTS``), and the CLI is generated
from the sections: every field is a flag of the same name.

What the engine learns at start-up (EOS ids, the number of KV pages, the resolved device) is
engine state, kept elsewhere; these objects never change after construction.
"""

from loom.config.http_args import HTTPArgs
from loom.config.lora_args import LoRAArgs
from loom.config.sections import (
    DEFAULT_MODEL,
    CacheArgs,
    GrammarArgs,
    KernelArgs,
    ModelArgs,
    SamplingArgs,
    SchedulerArgs,
)
from loom.config.server_args import DEVICE_DEFAULTS, SECTIONS, ServerArgs, device_defaults

__all__ = [
    "DEFAULT_MODEL",
    "DEVICE_DEFAULTS",
    "SECTIONS",
    "CacheArgs",
    "GrammarArgs",
    "HTTPArgs",
    "KernelArgs",
    "LoRAArgs",
    "ModelArgs",
    "SamplingArgs",
    "SchedulerArgs",
    "ServerArgs",
    "device_defaults",
]
