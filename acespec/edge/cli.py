"""`acespec edge`: draft locally, verify in the cloud, stream the text.

    acespec edge --cloud 127.0.0.1:7070 --mode pipelined --k 4 --prompt "..." --chat
    acespec edge --cloud 127.0.0.1:7070 --acespec --prompt "..." --chat     # pipelined + cache + branches + controller
    acespec edge --config edge.toml --prompt "..."                          # settings from a file, flags win

The flags are the fields of `acespec.config.EdgeRole` (see docs/operate/configuration.md).
"""

from __future__ import annotations

import argparse

from acespec.cli_output import TextOutput, prompt_tokens
from acespec.config import EdgeRole, add_cli_args, add_config_arg, parse_fleet, parse_hostport, resolve  # noqa: F401  (their old home; tests and tools import them here)
from acespec.edge import serve
from acespec.edge.options import drafter_options, edge_config
from acespec.edge.runtime import run_edge
from acespec.models import load_model


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("edge", help="run the edge: draft locally, verify in the cloud (`edge serve`: the HTTP API)")
    add_config_arg(p)
    add_cli_args(p, EdgeRole())
    p.set_defaults(func=cmd_edge)
    # `acespec edge serve ...`; plain `acespec edge --prompt ...` names no subcommand and runs as before
    edge_sub = p.add_subparsers(dest="edge_command", metavar="{serve}")
    serve.register(edge_sub)


def cmd_edge(args: argparse.Namespace) -> int:
    role: EdgeRole = resolve(EdgeRole(), args).config
    cfg = edge_config(role)
    if role.prompt is None:
        raise ValueError("--prompt is required (or run `acespec edge serve` for the HTTP API)")
    drafter = load_model(role.draft, n_ctx=role.n_ctx, **drafter_options(role))
    ids = prompt_tokens(drafter.tokenizer, role.prompt, role.chat)
    out = TextOutput(drafter.tokenizer, to_stdout=not role.json)
    produced: list[int] = []

    def push(toks: list[int]) -> None:
        produced.extend(toks)
        out.push(toks)

    try:
        res = run_edge(
            drafter if cfg.mode != "cloud-only" else None,
            ids,
            cfg,
            model_id=drafter.tokenizer.fingerprint,
            on_tokens=push,
        )
    except Exception as e:
        if role.json:  # the text committed so far is the caller's, failure or not
            out.finish(
                produced,
                {"mode": cfg.mode, "rule": role.sampling.rule, "emitted": len(produced)},
                as_json=True,
                error={
                    "message": str(e),
                    "code": getattr(getattr(e, "code", None), "name", None),
                    "type": type(e).__name__,
                },
            )
        raise
    s = res.stats.summary()
    s.update(mode=cfg.mode, rule=role.sampling.rule)
    out.finish(res.tokens, s, as_json=role.json)
    return 0
