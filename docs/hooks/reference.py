"""MkDocs hook: the Reference pages that are generated from the code, at every build.

    reference/cli.md        every `acespec` subcommand's --help, from the argparse parser (acespec.cli)
    reference/http-api.md   the edge's HTTP API, from its FastAPI app's OpenAPI schema (acespec.edge.api)
    reference/openapi.json  that schema, whole
    reference/metrics.md    every Prometheus metric the cloud and the edge export, from their collectors

Nothing here is committed: the pages are built from the checkout beside them, so they cannot drift from
the code. The hook imports AceSpec from this checkout (not an installed copy); what it imports needs
AceSpec's light runtime dependencies only (numpy, FastAPI, prometheus_client), never llama-cpp-python:
the edge app is built over the exact toy model, and no model file is read.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Iterator

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
HELP_WIDTH = "100"  # argparse wraps --help to $COLUMNS: a fixed width keeps the page the same on every machine


def on_files(files: Files, config: MkDocsConfig) -> Files:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    os.environ["COLUMNS"] = HELP_WIDTH
    schema = openapi_schema()
    pages = {
        "reference/cli.md": cli_page(),
        "reference/http-api.md": http_page(schema),
        "reference/openapi.json": json.dumps(schema, indent=2) + "\n",
        "reference/metrics.md": metrics_page(),
    }
    for uri, text in pages.items():
        files.append(File.generated(config, uri, content=text))
    return files


# ------------------------------------------------------------------------------------------ the CLI
def _subcommands(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """(full command, parser) for the parser and every subcommand under it, depth first, in declared order."""
    yield parser.prog, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _subcommands(sub)


def cli_page() -> str:
    from acespec.cli import build_parser

    commands = list(_subcommands(build_parser()))
    out = ["# Command line", "",
           "Every `acespec` subcommand with its `--help`, generated from the command's own parser at each build. "
           "Bad input to any of them is one line `acespec: error: ...` on stderr and exit status 2. "
           "The table of contents lists every subcommand.", ""]
    for prog, p in commands:
        out += ["", f"## {prog}" + " {#" + _anchor(prog) + "}", "", "```text", p.format_help().rstrip(), "```"]
    return "\n".join(out) + "\n"


def _anchor(prog: str) -> str:
    return prog.replace(" ", "-")


# ------------------------------------------------------------------------------------------ the HTTP API
def openapi_schema() -> dict:
    from acespec.edge.api import EdgeService, create_app
    from acespec.edge.service import ServeConfig
    from acespec.models import load_model

    svc = EdgeService([load_model("toy:vocab=64,seed=1")], ServeConfig())  # the schema depends on no model
    return create_app(svc).openapi()


def _type(s: dict, schemas: dict) -> str:
    if "$ref" in s:
        name = s["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#{name.lower()})"
    if "anyOf" in s:
        kinds = [_type(x, schemas) for x in s["anyOf"] if x.get("type") != "null"]
        return " or ".join(kinds) + (" or null" if any(x.get("type") == "null" for x in s["anyOf"]) else "")
    if "enum" in s:
        return " \\| ".join(f"`{v}`" for v in s["enum"])
    if s.get("type") == "array":
        return f"array of {_type(s.get('items', {}), schemas)}"
    return s.get("type", "any")


def _bounds(s: dict) -> str:
    found: dict[str, str] = {}
    for x in [s] + s.get("anyOf", []):
        for key, sign in (("minimum", ">="), ("exclusiveMinimum", ">"), ("maximum", "<="), ("exclusiveMaximum", "<"),
                          ("minItems", "items >=")):
            if key in x:
                v = x[key]
                if v == 2**64 or v == 2**31:
                    found[key] = f"{sign} 2^{int(v).bit_length() - 1}"
                else:
                    found[key] = f"{sign} {int(v)}" if float(v).is_integer() and abs(v) < 1e15 else f"{sign} {v:g}"
    return ", ".join(found.values())


def http_page(schema: dict) -> str:
    schemas = schema.get("components", {}).get("schemas", {})
    out = ["# HTTP API", "",
           "`acespec edge serve` speaks OpenAI's API; this page is generated from its FastAPI app's OpenAPI "
           "schema at each build (the whole schema: [openapi.json](openapi.json); a running edge serves it at "
           "`/openapi.json`). How the fields behave, errors included, is in "
           "[Operate: an edge device](../operate/edge.md#the-http-api).", "", "## Routes", "",
           "| method | path | answers |", "|---|---|---|"]
    for path, ops in schema["paths"].items():
        for method, op in ops.items():
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
            what = op.get("summary", "")
            if body:
                what += f" (body: {_type(body, schemas)})"
            out.append(f"| {method.upper()} | `{path}` | {what} |")
    for name in sorted(schemas):
        if name in ("HTTPValidationError", "ValidationError"):
            continue  # FastAPI's own; the edge answers 422 in OpenAI's error shape instead
        s = schemas[name]
        out += ["", f"## {name}", ""]
        if s.get("description"):
            out += [s["description"].strip(), ""]
        required = set(s.get("required", []))
        out += ["| field | type | default | bounds |", "|---|---|---|---|"]
        for field, fs in s.get("properties", {}).items():
            default = "required" if field in required else f"`{json.dumps(fs.get('default'))}`"
            out.append(f"| `{field}` | {_type(fs, schemas)} | {default} | {_bounds(fs)} |")
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------------------ metrics
class _EngineFigures(dict):
    """What a verify engine's metrics() returns, every figure 0: the collector then yields every metric
    that engine kind exports, with no server running."""

    def __missing__(self, key: str) -> Any:
        return [(1.0, 0)] if key == "tail_buckets" else 0


class _Server:
    """The attributes of a CloudServer the cloud's collector reads at scrape time."""

    def __init__(self, figures: dict) -> None:
        self.sessions: dict = {}
        self.handshakes: dict = {}
        self.errors_sent: dict = {}
        self.engine = type("Engine", (), {"metrics": lambda _self: figures})()


def _families(collected) -> list[tuple[str, str, str, tuple[str, ...]]]:
    out = []
    for fam in collected:
        suffix = "_total" if fam.type == "counter" else ""
        out.append((fam.name + suffix, fam.type, fam.documentation, tuple(getattr(fam, "_labelnames", ()))))
    return out


def metrics_page() -> str:
    from acespec.cloud.metrics import CloudCollector
    from acespec.edge.metrics import EdgeMetrics

    # which engine kind exports what: the serial engine reports the common figures only; the batched
    # engine (the default) adds its ticks and KV, the vLLM engine its requests and prefix cache
    kinds = {"serial": _EngineFigures(), "batched": _EngineFigures(ticks=0), "vllm": _EngineFigures(requests=0)}
    engines: dict[str, list[str]] = {}
    cloud: dict[str, tuple[str, str, tuple[str, ...]]] = {}
    for kind, figures in kinds.items():
        for name, typ, doc, labels in _families(CloudCollector(_Server(figures)).collect()):
            cloud[name] = (typ, doc, labels)
            engines.setdefault(name, []).append(kind)
    registry = EdgeMetrics(1).registry
    # a labelled metric with no samples yet shows no labels when collected; its collector object knows them
    labelled = {name: tuple(m._labelnames) for m, names in registry._collector_to_names.items()
                for name in names if getattr(m, "_labelnames", ())}
    edge = [(name, typ, doc, labelled.get(name, labels)) for name, typ, doc, labels in _families(registry.collect())]

    def row(name: str, typ: str, doc: str, labels: tuple[str, ...], where: str = "") -> str:
        lab = ", ".join(f"`{x}`" for x in labels)
        return f"| `{name}` | {typ} | {lab} | {doc}{where} |"

    out = ["# Metrics", "",
           "Every Prometheus metric AceSpec exports, generated from its collectors at each build. Names follow "
           "vLLM's where the meaning is the same, with the prefix `acespec:`; counters end in `_total`, "
           "histograms add `_bucket`, `_sum` and `_count`. What to watch, and why: "
           "[Operate: metrics](../operate/metrics.md).", "",
           "## The cloud", "",
           "`acespec serve --metrics-port P` serves these at `http://HOST:P/metrics`, read from the server and its "
           "verify engine at scrape time. Some figures exist only on some "
           "engines (`--engine`): the column says which.", "",
           "| metric | type | labels | meaning |", "|---|---|---|---|"]
    for name, (typ, doc, labels) in cloud.items():
        where = "" if len(engines[name]) == len(kinds) else f" (engine: {', '.join(engines[name])})"
        out.append(row(name, typ, doc, labels, where))
    out += ["", "## The edge", "", "`acespec edge serve` serves these at `/metrics` on its HTTP port.", "",
            "| metric | type | labels | meaning |", "|---|---|---|---|"]
    out += [row(*f) for f in edge]
    return "\n".join(out) + "\n"
