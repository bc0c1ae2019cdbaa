"""How long `loom serve` takes to exit under load, and how its requests end.

Starts a server on the default model, puts `loom bench serving` load on it, then after
``--after`` seconds sends the event and measures until the server's process has exited and its
scheduler process is gone:

    python bench/shutdown.py --event {SIGTERM,SIGINT,kill-scheduler,stop-scheduler}

``kill-scheduler`` SIGKILLs the scheduler (a crash); ``stop-scheduler`` SIGSTOPs it, then sends
SIGTERM to the server (a scheduler that answers nothing). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument(
        "--event",
        default="SIGTERM",
        choices=("SIGTERM", "SIGINT", "kill-scheduler", "stop-scheduler"),
    )
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--output-len", type=int, default=1024)
    p.add_argument("--after", type=float, default=5.0, help="seconds of load before the event")
    ns = p.parse_args()
    port = _port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "loom.cli", "serve", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    scheduler = httpx.get(url + "/server_info").json()["scheduler_pid"]
    load = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "loom.cli",
            "bench",
            "serving",
            "--base-url",
            url,
            "--num-prompts",
            str(ns.num_prompts),
            "--request-rate",
            "inf",
            "--random-input-len",
            "64",
            "--random-output-len",
            str(ns.output_len),
            "--random-range-ratio",
            "1.0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    time.sleep(ns.after)
    running = httpx.get(url + "/server_info").json().get("num_running_reqs")
    t0 = time.monotonic()
    if ns.event == "kill-scheduler":
        os.kill(scheduler, signal.SIGKILL)
    elif ns.event == "stop-scheduler":
        os.kill(scheduler, signal.SIGSTOP)
        server.send_signal(signal.SIGTERM)
    else:
        server.send_signal(getattr(signal, ns.event))
    rc = server.wait(timeout=60)
    exit_s = time.monotonic() - t0
    while _alive(scheduler) and time.monotonic() - t0 < 60:
        time.sleep(0.01)
    gone_s = time.monotonic() - t0
    out = load.communicate(timeout=120)[0]
    summary = next((line for line in out.splitlines() if "completed / errors" in line), "")
    print(
        json.dumps(
            {
                "event": ns.event,
                "running_at_event": running,
                "server_exit_s": round(exit_s, 2),
                "scheduler_gone_s": round(gone_s, 2),
                "server_rc": rc,
                "load": summary.split("errors", 1)[-1].strip(),
                "errors_seen": [
                    line[7:90] for line in out.splitlines() if line.startswith("error:")
                ][:2],
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
