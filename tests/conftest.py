from __future__ import annotations

import functools
import os
import pathlib
import random

import httpx
import pytest
import torch
from filelock import FileLock

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors (set before any import
# of triton, which Loom does lazily).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from loom.model_loader.model_path import resolve_model_path
from loom.testing._common import TINY_LLAMA as KIT_TINY_LLAMA

REPO = pathlib.Path(__file__).resolve().parent.parent
CACHE = REPO / ".cache"  # git-ignored; HF's GGUF load takes ~30 s, so its result is kept here

# HTTP calls to test servers wait up to a minute (httpx's default is 5 s): under pytest-xdist a
# server shares this machine's two cores with the other workers. A call's own timeout wins.
http_get = functools.partial(httpx.get, timeout=60)
http_post = functools.partial(httpx.post, timeout=60)
http_stream = functools.partial(httpx.stream, timeout=60)
http_request = functools.partial(httpx.request, timeout=60)

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 2 + 2?",
    "Write a haiku about the sea.",
    "Who wrote Romeo and Juliet?",
    "Give me a synonym for happy.",
    "What is the boiling point of water in Celsius?",
    "List the days of the week.",
]


@pytest.fixture(autouse=True)
def _seeded_rngs():
    """Every test starts from the same random state: draws that are not seeded by a request
    (the fused sampling kernel takes its base seed from ``random``) are then the same on every
    run, and the distribution tests' chi-square checks cannot fail by chance on CI."""
    random.seed(0)
    torch.manual_seed(0)


def pytest_collection_modifyitems(config, items):
    # Workers (pytest-xdist, `--dist loadgroup`) take whole modules, so each module-scoped
    # server or engine starts once; tests marked `spread` (long, and needing no module fixture)
    # go one by one to whichever worker is free.
    for item in items:
        if "spread" not in item.keywords:
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smol_gguf() -> str:
    return resolve_model_path("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def hf_ref_dir(smol_gguf: str) -> str:
    """SmolLM2 as HF transformers itself loads it from the GGUF (the oracle), saved once."""
    out = CACHE / "hf-ref" / "smollm2-135m-instruct-v2"
    CACHE.mkdir(parents=True, exist_ok=True)
    with FileLock(str(CACHE / "hf-ref.lock")):  # test workers (pytest-xdist) build it once
        if not (out / "done").exists():
            _save_hf_ref(smol_gguf, out)
    return str(out)


def _save_hf_ref(smol_gguf: str, out: pathlib.Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, f = os.path.dirname(smol_gguf), os.path.basename(smol_gguf)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    out.mkdir(parents=True, exist_ok=True)
    # save_pretrained refuses GGUF-"quantized" models; the weights are plain fp32 tensors.
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    config = model.config
    config.architectures = [type(model).__name__]
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "done").touch()


@pytest.fixture(scope="session")
def hf_model(hf_ref_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf_ref_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def engine():
    """One default engine (SmolLM2, fp32, CPU) shared by tests that don't need special flags."""
    import loom

    with loom.Engine(max_total_tokens=16384) as e:
        yield e


# The conformance kits' tiny Llama at HF's default initializer range
TINY_LLAMA = {k: v for k, v in KIT_TINY_LLAMA.items() if k != "initializer_range"}


def save_tiny_llama(path, seed: int = 0, **overrides) -> str:
    """A tiny random HF Llama saved with save_pretrained (safetensors); returns the path."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, **overrides})).eval().save_pretrained(path)
    return str(path)


def save_pt_copy(src: str, dst) -> str:
    """``src``'s safetensors checkpoint as a ``pytorch_model.bin`` (``torch.save`` of its
    tensors) with its config (transformers 5 writes safetensors whatever it is asked)."""
    import shutil

    from safetensors.torch import load_file

    dst = pathlib.Path(dst)
    dst.mkdir(parents=True)
    shutil.copy(pathlib.Path(src) / "config.json", dst / "config.json")
    torch.save(load_file(str(pathlib.Path(src) / "model.safetensors")), dst / "pytorch_model.bin")
    return str(dst)


def chat_ids(engine, prompt: str) -> list[int]:
    return engine.apply_chat_template([{"role": "user", "content": prompt}])


def hf_top1_agreement(hf_model, prompts: list[list[int]], outs: list[list[int]]) -> tuple[int, int]:
    """How many of ``outs``' tokens (each prompt's greedy answer) are HF's argmax given the same
    prefix (teacher-forced on ``outs``), and how many there are."""
    same = total = 0
    with torch.inference_mode():
        for p, o in zip(prompts, outs, strict=True):
            logits = hf_model(input_ids=torch.tensor([p + o])).logits[0, len(p) - 1 : -1]
            same += sum(int(a == b) for a, b in zip(logits.argmax(-1).tolist(), o, strict=True))
            total += len(o)
    return same, total
