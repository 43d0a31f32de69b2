"""The stack the API benches run: a cloud (`acespec serve`), a WAN emulator in front of it when a round
trip is asked for, and an edge API (`acespec edge serve`), each a child process of `kids`, each side on
the cores `--cores` gives it. One place builds their command lines, so `bench apps` and `bench api`
start the same stack and cannot drift apart; each adds its own flags through `serve` and `edge_serve`.

    with ChildProcesses() as kids:
        stack = start_stack(kids, cores="split", target=t, draft=d, n_ctx=4096, rtt_ms=100)
        ... POST to http://127.0.0.1:{stack.api_port}/v1/chat/completions ...
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from acespec.bench.children import ChildProcesses, wait_for_line
from acespec.models.llama import on_cpus, split_cpus, split_threads

EXE = [sys.executable, "-m", "acespec.cli"]
LISTENING = r"listening on [\d.]+:(\d+)"  # what `serve` and `wan` print once their port is open
START_S = 300.0  # a model's load, on a cold page cache and a busy machine


@dataclass(frozen=True)
class Stack:
    cloud_port: int  # where an edge reaches the cloud: the emulator's port when a round trip is emulated
    api_port: int  # the edge API's HTTP port
    edge_threads: int | None  # the edge side's model threads (None: the runtime's default)
    edge_cpus: set[int] | None  # the edge side's CPUs, for work the bench itself runs as an edge (None: all)


def side_env(threads: int | None) -> dict[str, str]:
    """The environment of one side's processes: its model thread count, where `--cores` sets one."""
    return {**os.environ, **({"ACESPEC_THREADS": str(threads)} if threads else {})}


def start_stack(
    kids: ChildProcesses,
    *,
    cores: str,
    target: str,
    draft: str,
    n_ctx: int,
    rtt_ms: float,
    serve: Sequence[str] = (),
    edge_serve: Sequence[str] = (),
) -> Stack:
    """Start the cloud on its cores, then the emulator (when `rtt_ms` > 0) and the edge API on the edge's,
    and wait until each says it is up."""
    edge_threads, cloud_threads = split_threads(cores)
    edge_cpus, cloud_cpus = split_cpus(cores)
    with on_cpus(cloud_cpus):
        cloud = kids.start(
            [*EXE, "serve", "--target", target, "--port", "0", "--n-ctx", str(n_ctx), *serve],
            env=side_env(cloud_threads),
        )
    port = int(wait_for_line(cloud, LISTENING, START_S, "the cloud").group(1))
    with on_cpus(edge_cpus):
        if rtt_ms > 0:
            wan = kids.start(
                [*EXE, "wan", "--listen", "127.0.0.1:0", "--upstream", f"127.0.0.1:{port}"]
                + ["--profile", "lan", "--rtt", f"{rtt_ms:g}", "--jitter", "0"],
                env=side_env(edge_threads),
            )
            port = int(wait_for_line(wan, LISTENING, 60, "the WAN emulator").group(1))
        api = kids.start(
            [*EXE, "edge", "serve", "--cloud", f"127.0.0.1:{port}", "--draft", draft, "--port", "0"]
            + ["--n-ctx", str(n_ctx), *edge_serve],
            env=side_env(edge_threads),
        )
    api_port = int(wait_for_line(api, r"http://[\d.]+:(\d+)", START_S, "the edge API").group(1))
    return Stack(cloud_port=port, api_port=api_port, edge_threads=edge_threads, edge_cpus=edge_cpus)
