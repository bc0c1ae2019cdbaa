"""Run SGLang's load generator (``python -m sglang.bench_serving``) from its wheel installed with
``--no-deps``, as a second opinion on ``loom bench serving``.

``sglang/__init__.py`` imports IPython and ``sglang/srt/utils/__init__.py`` imports torch,
triton and torchvision, none of which the benchmark client uses; it needs only
``sglang.benchmark`` and ``sglang.srt.utils.network``. So those three packages are registered
as bare namespaces (their ``__init__`` files never run) before the module is run as a script.
HF ``datasets`` is needed only by the mmmu dataset and is replaced by a stub that says so.

    python3 bench/sglang_bench_serving.py --backend sglang --dataset-name random-ids ...
"""

import importlib.machinery
import importlib.util
import os
import runpy
import sys
import types


def _bare_package(name: str, path: str) -> None:
    mod = types.ModuleType(name)
    mod.__path__ = [path]
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    mod.__spec__.submodule_search_locations = mod.__path__
    sys.modules[name] = mod


def main() -> None:
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        raise SystemExit("sglang is not installed (pip install --no-deps sglang)")
    root = os.path.dirname(spec.origin)
    _bare_package("sglang", root)
    _bare_package("sglang.srt", os.path.join(root, "srt"))
    _bare_package("sglang.srt.utils", os.path.join(root, "srt", "utils"))
    if importlib.util.find_spec("datasets") is None:
        stub = types.ModuleType("datasets")

        def load_dataset(*args, **kwargs):
            raise ImportError("HF datasets is not installed (only --dataset-name mmmu needs it)")

        stub.load_dataset = load_dataset
        sys.modules["datasets"] = stub
    sys.argv[0] = "sglang.bench_serving"
    runpy.run_module("sglang.bench_serving", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
