"""``loom serve | generate | bench offline | bench serving | plugins``. Plug-ins are discovered before arguments are
parsed, so flag choices and ``--help`` include out-of-tree names."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from loom import plugins
from loom.config import ServerArgs


def _cmd_plugins(ns: argparse.Namespace) -> int:
    families = [ns.family] if ns.family else list(plugins.FAMILIES)
    for name in families:
        if name not in plugins.FAMILIES:
            print(
                f"unknown family {name!r}; families: {', '.join(plugins.FAMILIES)}", file=sys.stderr
            )
            return 2
    for name in families:
        fam = plugins.FAMILIES[name]
        default = f", default {fam.default}" if fam.default else ""
        print(f"{name}  ({fam.flag}{default})")
        entries = plugins.entries(name)
        if not entries:
            print("    (none registered yet)")
        for e in entries:
            ok, why = plugins.is_available(e)
            status = "available" if ok else f"unavailable: {why}"
            print(f"    {e.name:<24} {e.origin:<32} {status}")
    failed = plugins.failed_plugins()
    if failed:
        print("plug-ins that failed to load:")
        for name, err in failed.items():
            print(f"    {name}: {err}")
    return 0


def _cmd_generate(ns: argparse.Namespace) -> int:
    from loom.engine.engine import Engine

    params: dict[str, Any] = {
        "max_new_tokens": ns.max_new_tokens,
        "temperature": ns.temperature,
        "top_p": ns.top_p,
        "top_k": ns.top_k,
    }
    if ns.seed is not None:
        params["sampling_seed"] = ns.seed
    with Engine(**_server_kwargs(ns)) as engine:
        for prompt in ns.prompt:
            if ns.chat:
                ids = engine.apply_chat_template([{"role": "user", "content": prompt}])
                stream = engine.generate(input_ids=ids, sampling_params=params, stream=True)
            else:
                stream = engine.generate(prompt, params, stream=True)
            if len(ns.prompt) > 1 or not ns.chat:
                print(f">>> {prompt}")
            for inc in stream:
                print(inc["text"], end="", flush=True)
            print()
    return 0


def _cmd_serve(ns: argparse.Namespace) -> int:
    from loom.server.launch import serve

    return serve(_server_kwargs(ns))


def _server_kwargs(ns: argparse.Namespace) -> dict[str, Any]:
    return ServerArgs.from_cli_args(ns).to_dict()


def build_parser() -> argparse.ArgumentParser:
    plugins.ensure_loaded()
    parser = argparse.ArgumentParser(prog="loom", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plugins", help="list plug-in families and their members")
    p.add_argument("family", nargs="?", help="only this family")
    p.set_defaults(func=_cmd_plugins)

    p = sub.add_parser("serve", help="serve the model over HTTP (OpenAI and SGLang APIs)")
    ServerArgs.add_cli_args(p)
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("generate", help="generate text offline")
    p.add_argument("prompt", nargs="+", help="prompt text (several are run one after another)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    ServerArgs.add_cli_args(p)
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("bench", help="benchmarks")
    bench = p.add_subparsers(dest="bench", required=True)
    from loom.bench.offline import add_offline_args, run_offline

    b = bench.add_parser("offline", help="offline throughput (optionally against HF)")
    add_offline_args(b)
    ServerArgs.add_cli_args(b)
    b.set_defaults(func=lambda ns: run_offline(ns, _server_kwargs(ns)))

    from loom.bench.latency import add_latency_args, run_latency

    b = bench.add_parser("latency", help="one batch: prefill ms, decode ms per step")
    add_latency_args(b)
    ServerArgs.add_cli_args(b)
    b.set_defaults(func=lambda ns: run_latency(ns, _server_kwargs(ns)))

    from loom.bench.prefix import add_prefix_args, run_prefix

    b = bench.add_parser(
        "prefix", help="prefix-cache workloads: shared prefix, 0%% hits, multi-turn"
    )
    add_prefix_args(b)
    ServerArgs.add_cli_args(b)
    b.set_defaults(func=lambda ns: run_prefix(ns, _server_kwargs(ns)))

    from loom.bench.structured import add_structured_args, run_structured

    b = bench.add_parser("structured", help="constrained vs unconstrained decoding, compile times")
    add_structured_args(b)
    ServerArgs.add_cli_args(b)
    b.set_defaults(func=lambda ns: run_structured(ns, _server_kwargs(ns)))

    from loom.bench.load import add_load_args, run_load

    b = bench.add_parser("load", help="load time and peak memory of each --load-format")
    add_load_args(b)
    ServerArgs.add_cli_args(b)
    b.set_defaults(func=lambda ns: run_load(ns, _server_kwargs(ns)))

    from loom.bench.lora import add_lora_args, run_lora

    b = bench.add_parser("lora", help="time to first token by where the adapter is")
    add_lora_args(b)
    ServerArgs.add_cli_args(b)
    b.set_defaults(func=lambda ns: run_lora(ns, _server_kwargs(ns)))

    from loom.bench.serving import add_serving_args, run_serving

    b = bench.add_parser("serving", help="send HTTP streaming requests to a running server")
    add_serving_args(b)
    b.set_defaults(func=run_serving)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        return ns.func(ns) or 0
    except (ValueError, FileNotFoundError, plugins.RegistryError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
