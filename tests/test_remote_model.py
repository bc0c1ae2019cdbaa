"""``--model URL``: a model served over HTTP (or in an fsspec store) is copied into the cache,
resuming an interrupted copy, and serves the tokens of the same model read locally."""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import threading

import pytest
import torch

import loom
from loom.model_loader.remote import cache_dir, fetch_model
from tests.conftest import save_tiny_llama

KW = dict(skip_tokenizer_init=True, max_total_tokens=1024, dtype="float32")
PARAMS = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


class _RangeHandler(http.server.SimpleHTTPRequestHandler):
    """Static files with ``Range: bytes=N-`` answered 206 (the standard handler ignores it)."""

    ranges: list[str] = []

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        spec = self.headers.get("Range")
        path = self.translate_path(self.path)
        if spec is None or not os.path.isfile(path):
            return super().do_GET()
        type(self).ranges.append(self.path + " " + spec)
        start = int(spec.removeprefix("bytes=").rstrip("-"))
        data = open(path, "rb").read()[start:]
        self.send_response(206)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def served(tmp_path, monkeypatch):
    """A tiny Llama on an HTTP server, and Loom's cache in this test's directory."""
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path / "cache"))
    model = save_tiny_llama(tmp_path / "www" / "tiny", vocab_size=256, initializer_range=0.2)
    handler = functools.partial(_RangeHandler, directory=str(tmp_path / "www"))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _RangeHandler.ranges = []
    yield model, f"http://127.0.0.1:{server.server_address[1]}/tiny"
    server.shutdown()


def _greedy(model: str) -> list[list[int]]:
    prompts = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(0)).tolist()
    with loom.Engine(model=model, **KW) as e:
        return [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=PARAMS)]


def test_a_model_over_http_serves_the_local_models_tokens(served):
    local, url = served
    assert _greedy(url) == _greedy(local)
    copy = cache_dir(url)
    assert sorted(os.listdir(copy)) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]


def test_an_interrupted_copy_resumes_with_a_range_request(served):
    local, url = served
    weights = open(os.path.join(local, "model.safetensors"), "rb").read()
    root = cache_dir(url)
    os.makedirs(root)
    half = len(weights) // 2
    with open(os.path.join(root, "model.safetensors.part"), "wb") as f:
        f.write(weights[:half])
    fetch_model(url)
    assert _RangeHandler.ranges == [f"/tiny/model.safetensors bytes={half}-"]
    assert open(os.path.join(root, "model.safetensors"), "rb").read() == weights
    assert not os.path.exists(os.path.join(root, "model.safetensors.part"))
    fetch_model(url)  # complete: nothing fetched again
    assert len(_RangeHandler.ranges) == 1


def test_a_missing_model_is_named(served):
    _, url = served
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        fetch_model(url + "-nowhere")


def test_an_fsspec_store(tmp_path, monkeypatch):
    import fsspec

    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path / "cache"))
    local = save_tiny_llama(tmp_path / "tiny", vocab_size=256, initializer_range=0.2)
    fs = fsspec.filesystem("memory")
    for name in os.listdir(local):
        fs.pipe(f"/loom-test-tiny/{name}", open(os.path.join(local, name), "rb").read())
    try:
        assert _greedy("memory://loom-test-tiny") == _greedy(local)
    finally:
        fs.rm("/loom-test-tiny", recursive=True)
        shutil.rmtree(tmp_path / "cache", ignore_errors=True)
