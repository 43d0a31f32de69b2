"""`acespec edge`: draft locally, verify in the cloud, stream the text.

    acespec edge --cloud 127.0.0.1:7070 --mode pipelined --k 4 --prompt "..." --chat
    acespec edge --cloud 127.0.0.1:7070 --acespec --prompt "..." --chat     # pipelined + cache + branches + controller
"""

from __future__ import annotations

import argparse


def parse_hostport(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    try:
        p = int(port)
    except ValueError:
        raise ValueError(f"bad port in {text!r}") from None
    if not 0 < p < 65536:
        raise ValueError(f"port out of range in {text!r}")
    return host.strip("[]"), p


def parse_fleet(text: str) -> list[tuple[str, int]]:
    """"HOST:PORT[,HOST:PORT...]": one cloud, or the replicas of a fleet."""
    parts = [t.strip() for t in text.split(",")]
    if not all(parts):
        raise ValueError(f"expected HOST:PORT[,HOST:PORT...], got {text!r}")
    out = [parse_hostport(t) for t in parts]
    if len(set(out)) != len(out):
        raise ValueError(f"--cloud lists an address twice: {text!r}")
    return out


def add_edge_options(p: argparse.ArgumentParser, *, modes: tuple[str, ...]) -> None:
    """The edge's run options, shared by `acespec edge` and `acespec edge serve`."""
    from acespec.argtypes import pos_float, pos_float_or_inf
    from acespec.cli import _positive_int
    from acespec.control.depth import DEFAULT_PASS_BUDGET
    from acespec.models.registry import DEFAULT_DRAFT

    p.add_argument("--draft", default=DEFAULT_DRAFT, help=f"drafter model (default {DEFAULT_DRAFT})")
    p.add_argument("--cloud", help="HOST:PORT of the cloud verifier (or the WAN emulator); a fleet: HOST:PORT,HOST:PORT,... "
                                   "or a name that resolves to several addresses; required")
    p.add_argument("--mode", choices=modes, default="auto",
                   help="auto (default): the cloud streams and never waits, drafts join when ready; "
                        "sync, pipelined: edge-led; cloud-led; cloud-only: no drafting")
    p.add_argument("--k", type=_positive_int, default=4)
    p.add_argument("--policy", choices=["fixed", "adaptive", "controller"], default="fixed")
    p.add_argument("--window", type=_positive_int, default=2, help="pipelined: blocks in flight")
    p.add_argument("--auto-window", action="store_true", help="pipelined: grow the window to cover the measured round trip")
    p.add_argument("--pass-budget", type=pos_float_or_inf, default=DEFAULT_PASS_BUDGET,
                   help="target verify passes per token the cloud grants, kept by --policy controller and "
                        f"--acespec (default {DEFAULT_PASS_BUDGET}; inf = no limit)")
    p.add_argument("--cache", action="store_true", help="pre-draft the likely verdict outcomes (the state cache)")
    p.add_argument("--cache-budget-mb", type=pos_float, default=32.0, help="state-cache memory budget (default 32)")
    p.add_argument("--branches", action="store_true", help="also send pre-drafted outcomes as branch blocks (needs --cache)")
    p.add_argument("--acespec", action="store_true",
                   help="the full system: pipelined, --cache --branches --auto-window and --policy controller")
    p.add_argument("--token-file", help="file holding this tenant's auth token")
    p.add_argument("--tls-ca", help="TLS: connect with TLS, checking the cloud's certificate against this CA (PEM)")
    p.add_argument("--tls", action="store_true", help="TLS with the system's trusted CAs (implied by --tls-ca)")
    p.add_argument("--tls-cert", help="TLS: this edge's certificate (PEM), for a cloud that asks for one")
    p.add_argument("--tls-key", help="TLS: this edge's private key (PEM)")
    p.add_argument("--tls-server-name", help="TLS: the name the cloud's certificate must carry (default: the --cloud host)")
    p.add_argument("--busy-retry", type=float, default=60.0, metavar="S",
                   help="keep retrying a cloud that answers BUSY for this long, with backoff (default 60)")
    p.add_argument("--n-ctx", type=_positive_int, default=4096)


def register(sub: argparse._SubParsersAction) -> None:
    from acespec.cli import add_sampling_args

    p = sub.add_parser("edge", help="run the edge: draft locally, verify in the cloud (`edge serve`: the HTTP API)")
    add_edge_options(p, modes=("auto", "sync", "pipelined", "cloud-only", "cloud-led"))
    p.add_argument("--prompt", help="the prompt (required)")
    p.add_argument("--chat", action="store_true")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (text, stats) instead of streaming; on failure too, with the text so far and the error")
    add_sampling_args(p)
    p.set_defaults(func=cmd_edge)
    # `acespec edge serve ...`; plain `acespec edge --prompt ...` names no subcommand and runs as before
    edge_sub = p.add_subparsers(dest="edge_command", metavar="{serve}")
    from acespec.edge.serve import register as register_serve

    register_serve(edge_sub)


def edge_config_from_args(args: argparse.Namespace, *, controller_default: bool = False, serving: bool = False):
    """(EdgeConfig, drafter load options) from the edge's options, checked; shared with `edge serve`
    (`controller_default`: its default mode runs the controller, so --pass-budget has a taker;
    `serving`: --cache and --branches are defaults for the requests whose mode can use them)."""
    from acespec.cloud.cli import read_token
    from acespec.control.depth import DEFAULT_PASS_BUDGET
    from acespec.draft.cache import DRAFTER_SLOTS
    from acespec.edge.client import ConnectConfig
    from acespec.edge.runtime import EdgeConfig
    from acespec.verify import RuleSpec

    if not args.cloud:
        raise ValueError("--cloud HOST:PORT is required")
    (host, port), *replicas = parse_fleet(args.cloud)
    RuleSpec.parse(args.rule)
    if args.window < 1:
        raise ValueError("--window must be >= 1")
    if args.acespec:
        if args.mode not in ("pipelined", "auto"):  # auto: the default, i.e. no --mode given
            raise ValueError(f"--acespec runs pipelined; it cannot be combined with --mode {args.mode}")
        args.mode, args.cache, args.branches, args.auto_window, args.policy = "pipelined", True, True, True, "controller"
    if args.pass_budget != DEFAULT_PASS_BUDGET and args.policy != "controller" and not controller_default:
        raise ValueError("--pass-budget is kept by the controller: add --policy controller (or --acespec)")
    if args.branches and not args.cache:
        raise ValueError("--branches needs --cache")
    if args.cache and args.mode in ("cloud-only", "cloud-led", "auto") and not serving:
        raise ValueError("--cache needs an edge-led mode (sync or pipelined)")
    token = read_token(args.token_file) or b""
    tls = None
    if args.tls or args.tls_ca or args.tls_cert or args.tls_key:
        from acespec.tls import client_context

        tls = client_context(args.tls_ca, args.tls_cert, args.tls_key)
    if not args.busy_retry >= 0:
        raise ValueError("--busy-retry must be >= 0")
    slots = {"n_slots": DRAFTER_SLOTS} if args.cache and not args.draft.startswith("toy") else {}
    cfg = EdgeConfig(
        mode=args.mode, rule=args.rule, k=args.k, policy=args.policy, window=args.window, auto_window=args.auto_window,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed or 0, max_tokens=args.max_tokens,
        cache=args.cache, cache_budget_mb=args.cache_budget_mb, branches=args.branches, pass_budget=args.pass_budget,
        connect=ConnectConfig(host=host, port=port, token=token, tls=tls, tls_server_name=args.tls_server_name,
                              busy_retry_s=args.busy_retry, replicas=tuple(replicas)),
    )
    return cfg, slots


def cmd_edge(args: argparse.Namespace) -> int:
    from acespec.cli import TextOutput, prompt_tokens
    from acespec.edge.runtime import run_edge
    from acespec.models import load_model

    cfg, slots = edge_config_from_args(args)
    if args.prompt is None:
        raise ValueError("--prompt is required (or run `acespec edge serve` for the HTTP API)")
    drafter = load_model(args.draft, n_ctx=args.n_ctx, **slots)
    ids = prompt_tokens(drafter.tokenizer, args.prompt, args.chat)
    out = TextOutput(drafter.tokenizer, to_stdout=not args.json)
    produced: list[int] = []

    def push(toks: list[int]) -> None:
        produced.extend(toks)
        out.push(toks)

    try:
        res = run_edge(drafter if args.mode != "cloud-only" else None, ids, cfg, model_id=drafter.tokenizer.fingerprint, on_tokens=push)
    except Exception as e:
        if args.json:  # the text committed so far is the caller's, failure or not
            out.finish(produced, {"mode": args.mode, "rule": args.rule, "emitted": len(produced)}, as_json=True,
                       error={"message": str(e), "code": getattr(getattr(e, "code", None), "name", None), "type": type(e).__name__})
        raise
    s = res.stats.summary()
    s.update(mode=args.mode, rule=args.rule)
    out.finish(res.tokens, s, as_json=args.json)
    return 0
