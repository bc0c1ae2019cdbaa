"""Models at a URL: ``--model https://host/dir/`` (or any fsspec URL: ``s3://``, ``gs://``,
``memory://``...) is copied file by file into Loom's cache, ``$LOOM_CACHE_DIR/remote/<hash of
the URL>``, and every loader reads that copy. A file is written as ``NAME.part`` and renamed when
complete, so an interrupted copy resumes where it stopped (an HTTP ``Range`` request; a seek
for fsspec stores) and a complete one is not fetched again.

Which files: a URL ending in ``.gguf`` is that file alone; otherwise ``config.json`` (required),
the tokenizer's and generation config's files when present, and the weights:
``model.safetensors.index.json`` and its shards, else ``model.safetensors``, else
``pytorch_model.bin``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable

from tqdm.auto import tqdm

from loom import env

OPTIONAL = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
CHUNK = 1 << 20


def is_url(model: str) -> bool:
    return "://" in model


def cache_dir(url: str) -> str:
    return os.path.join(env.cache_root(), "remote", hashlib.sha256(url.encode()).hexdigest()[:16])


class _Http:
    def __init__(self) -> None:
        import httpx

        self.client = httpx.Client(follow_redirects=True, timeout=60)

    def fetch(self, url: str, part: str, have: int, write: Callable[[bytes], None]) -> bool:
        """Write ``url``'s bytes from ``have`` on (all when the server ignores the range);
        False when it is not there."""
        headers = {"Range": f"bytes={have}-"} if have else {}
        with self.client.stream("GET", url, headers=headers) as r:
            if r.status_code == 404:
                return False
            if r.status_code == 416:  # the part already holds every byte
                return True
            if r.status_code >= 400:
                raise OSError(f"{url}: HTTP {r.status_code}")
            if have and r.status_code != 206:  # no ranges here: start over
                os.truncate(part, 0)
            size = int(r.headers.get("content-length", 0)) or None
            with tqdm(
                total=size, unit="B", unit_scale=True, desc=url.rsplit("/", 1)[-1], leave=False
            ) as bar:
                for chunk in r.iter_bytes(CHUNK):
                    write(chunk)
                    bar.update(len(chunk))
        return True


class _Fsspec:
    def __init__(self, url: str) -> None:
        import fsspec

        self.fs = fsspec.core.url_to_fs(url)[0]

    def fetch(self, url: str, part: str, have: int, write: Callable[[bytes], None]) -> bool:
        path = self.fs._strip_protocol(url)
        if not self.fs.exists(path):
            return False
        with self.fs.open(path, "rb") as f:
            f.seek(have)
            while chunk := f.read(CHUNK):
                write(chunk)
        return True


def _get(source, url: str, dest: str) -> bool:
    """``url`` into ``dest`` through ``NAME.part`` (resumed if present); False if missing."""
    if os.path.exists(dest):
        return True
    part = dest + ".part"
    have = os.path.getsize(part) if os.path.exists(part) else 0
    with open(part, "ab") as f:
        found = source.fetch(url, part, have, f.write)
    if not found:
        if os.path.getsize(part) == 0:
            os.remove(part)
        return False
    os.replace(part, dest)
    return True


def fetch_model(url: str) -> str:
    """The local copy of the model at ``url`` (a directory, or the ``.gguf`` file), fetched
    into the cache as far as it is not there yet. Raises FileNotFoundError naming a missing
    required file."""
    base = url.rstrip("/")
    source = _Http() if base.split("://", 1)[0] in ("http", "https") else _Fsspec(base)
    root = cache_dir(base)
    os.makedirs(root, exist_ok=True)
    if base.endswith(".gguf"):
        dest = os.path.join(root, base.rsplit("/", 1)[-1])
        if not _get(source, base, dest):
            raise FileNotFoundError(f"model {url!r} not found")
        return dest

    def get(name: str, required: bool = False) -> bool:
        found = _get(source, f"{base}/{name}", os.path.join(root, name))
        if required and not found:
            raise FileNotFoundError(f"model {url!r} has no {name}")
        return found

    get("config.json", required=True)
    for name in OPTIONAL:
        get(name)
    if get("model.safetensors.index.json"):
        with open(os.path.join(root, "model.safetensors.index.json")) as f:
            for shard in sorted(set(json.load(f)["weight_map"].values())):
                get(shard, required=True)
    elif not get("model.safetensors") and not get("pytorch_model.bin"):
        raise FileNotFoundError(
            f"model {url!r} has no model.safetensors(.index.json) or pytorch_model.bin"
        )
    return root
