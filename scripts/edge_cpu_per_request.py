"""What an auto request costs the edge beside cloud-only: per-request wall time and the edge's CPU time.

Starts a cloud (`acespec serve`, CPU 0, verbose: it logs each cloud-led session's pricer) and `acespec
edge serve` (CPU 1), ACESPEC_THREADS=1 each, optionally a WAN emulator on CPU 1 (RTT=ms), and streams
N prompts of SET through the OpenAI API in cloud-only and auto, taking turns. It prints each request's
first-token and whole time and the CPU seconds the edge process spent on it. A drafter that reads a
prompt for a draft nobody verifies shows as edge CPU in auto beside cloud-only's few hundredths:
1.4-1.7 s per HumanEval request when a resting edge still drafted once per request
(docs/design-notes.md). Extra arguments go to `acespec edge serve`.

    SET=humaneval N=4 RTT=0 .venv/bin/python scripts/edge_cpu_per_request.py
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time

import openai

from acespec.eval.datasets import load_items
from acespec.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET

LOGS = tempfile.mkdtemp(prefix="acespec-edge-cpu-")
ENV = {**os.environ, "ACESPEC_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def start(argv: list[str], cpu: str, name: str) -> tuple[subprocess.Popen, str]:
    log = os.path.join(LOGS, name + ".log")
    cmd = ["taskset", "-c", cpu, sys.executable, "-m", "acespec.cli", *argv]
    return subprocess.Popen(cmd, env=ENV, stdout=open(log, "w"), stderr=subprocess.STDOUT), log


def port_in(log: str, rx: str, timeout: float = 300) -> int:
    t = time.time()
    while time.time() - t < timeout:
        m = re.search(rx, open(log).read())
        if m:
            return int(m.group(1))
        time.sleep(0.2)
    raise SystemExit(f"no port in {log}")


def cpu_s(pid: int) -> float:
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    sset, n, rtt = os.environ.get("SET", "humaneval"), int(os.environ.get("N", "4")), int(os.environ.get("RTT", "0"))
    procs = []
    try:
        serve = ["serve", "--target", DEFAULT_TARGET, "--port", "0", "--n-ctx", "4096", "--no-prefix-reuse"]
        cloud, cloud_log = start([*serve, "--verbose"], "0", "cloud")
        procs.append(cloud)
        port = port_in(cloud_log, r"listening on [\d.]+:(\d+)")
        if rtt:
            wan_argv = ["wan", "--listen", "127.0.0.1:0", "--upstream", f"127.0.0.1:{port}", "--profile", "lan"]
            wan, wan_log = start([*wan_argv, "--rtt", str(rtt), "--jitter", "0"], "1", "wan")
            procs.append(wan)
            port = port_in(wan_log, r"listening on [\d.]+:(\d+)")
        edge_argv = ["edge", "serve", "--cloud", f"127.0.0.1:{port}", "--draft", DEFAULT_DRAFT, "--port", "0"]
        edge, edge_log = start([*edge_argv, "--n-ctx", "4096", *sys.argv[1:]], "1", "edge")
        procs.append(edge)
        api = port_in(edge_log, r"http://[\d.]+:(\d+)")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{api}/v1", api_key="x", max_retries=0, timeout=600)

        def once(mode: str, text: str, max_tokens: int = 64) -> tuple[float, float, float]:
            c0, t0, first = cpu_s(edge.pid), time.perf_counter(), None
            for ch in client.chat.completions.create(
                model="acespec",
                messages=[{"role": "user", "content": text}],
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                extra_body={"mode": mode, "rule": "greedy"},
            ):
                if first is None and any(x.delta.content for x in ch.choices):
                    first = time.perf_counter()
            wall = time.perf_counter() - t0
            return (first or t0 + wall) - t0, wall, cpu_s(edge.pid) - c0

        once("auto", "Hi", 4), once("cloud-only", "Hi", 4)  # warm both paths
        extra = {"min_chars": 32} if sset == "sharegpt" else {}
        for i, it in enumerate(load_items(sset, n, **extra)):
            res = {m: once(m, it.text) for m in (["cloud-only", "auto"] if i % 2 == 0 else ["auto", "cloud-only"])}
            (ct, cw, cc), (at, aw, ac) = res["cloud-only"], res["auto"]
            print(
                f"{it.id:22s} cloud-only ttft {ct:.2f} s wall {cw:.2f} s edge cpu {cc:.2f} s | "
                f"auto ttft {at:.2f} s wall {aw:.2f} s edge cpu {ac:.2f} s | speed {cw / aw:.3f}x",
                flush=True,
            )
        print(f"logs (the cloud's pricer per cloud-led session): {LOGS}")
    finally:
        for p in procs:
            p.terminate()


if __name__ == "__main__":
    main()
