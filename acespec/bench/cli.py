"""`acespec bench ...`: the benchmark subcommands.

`bench` is a subcommand group. Each benchmark lives in its own module and, if that module exists and
has `add_parser(bench_subparsers)`, adds its own subcommand: `acespec.bench.local` (`bench local`),
`acespec.bench.wan` (`bench wan`), `acespec.bench.acespec_bench` (`bench acespec`), `acespec.bench.sim`
(`bench sim`), `acespec.bench.cost` (`bench cost`), `acespec.bench.tenants` (`bench tenants`), `acespec.bench.capacity` (`bench capacity`). A missing module is skipped, so benchmarks can
land independently; an import error *inside* an existing module is not swallowed.
"""

from __future__ import annotations

import argparse

# benchmark modules that may register a subcommand, in help order
_BENCH_MODULES = (
    "acespec.bench.local",
    "acespec.bench.wan",
    "acespec.bench.acespec_bench",
    "acespec.bench.sim",
    "acespec.bench.cost",
    "acespec.bench.tenants",
    "acespec.bench.faults",
    "acespec.bench.fleet",
    "acespec.bench.frontend",
    "acespec.bench.fuzz",
    "acespec.bench.fuzz_http",
    "acespec.bench.api",
    "acespec.bench.capacity",
    "acespec.bench.plugin_cost",
    "acespec.bench.peer",
    "acespec.bench.apps",
    "acespec.bench.drafters",
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks (see `acespec bench -h`)")
    bench_sub = p.add_subparsers(dest="bench", required=True)
    for mod in _BENCH_MODULES:
        try:
            module = __import__(mod, fromlist=["add_parser"])
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise
            continue
        if hasattr(module, "add_parser"):
            module.add_parser(bench_sub)
