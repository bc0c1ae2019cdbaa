"""``loom bench``: offline, latency, prefix, structured and serving benchmarks."""

from __future__ import annotations

import json
from typing import Any


def append_result(path: str | None, result: dict[str, Any]) -> None:
    """Append ``result`` as one JSON line to ``path`` (``--result-file``), if given."""
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(result) + "\n")
