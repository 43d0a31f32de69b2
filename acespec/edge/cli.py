"""`acespec edge`: draft locally, verify in the cloud, stream the text.

    acespec edge --cloud 127.0.0.1:7070 --mode pipelined --k 4 --prompt "..." --chat
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


def register(sub: argparse._SubParsersAction) -> None:
    from acespec.cli import _positive_int, add_sampling_args
    from acespec.models.registry import DEFAULT_DRAFT

    p = sub.add_parser("edge", help="run the edge: draft locally, verify in the cloud")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help=f"drafter model (default {DEFAULT_DRAFT})")
    p.add_argument("--cloud", required=True, help="HOST:PORT of the cloud verifier (or the WAN emulator)")
    p.add_argument("--mode", choices=["sync", "pipelined", "cloud-only"], default="pipelined")
    p.add_argument("--k", type=_positive_int, default=4)
    p.add_argument("--policy", choices=["fixed", "adaptive", "controller"], default="fixed")
    p.add_argument("--window", type=_positive_int, default=2, help="pipelined: blocks in flight")
    p.add_argument("--token-file", help="file holding the shared auth token")
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true")
    p.add_argument("--n-ctx", type=_positive_int, default=4096)
    p.add_argument("--json", action="store_true", help="print one JSON object (text, stats) instead of streaming")
    add_sampling_args(p)
    p.set_defaults(func=cmd_edge)


def cmd_edge(args: argparse.Namespace) -> int:
    from acespec.cli import TextOutput, prompt_tokens
    from acespec.cloud.cli import read_token
    from acespec.edge.client import ConnectConfig
    from acespec.edge.runtime import EdgeConfig, run_edge
    from acespec.models import load_model
    from acespec.verify import RuleSpec

    host, port = parse_hostport(args.cloud)
    RuleSpec.parse(args.rule)
    if args.window < 1:
        raise ValueError("--window must be >= 1")
    token = read_token(args.token_file) or b""
    drafter = load_model(args.draft, n_ctx=args.n_ctx)
    ids = prompt_tokens(drafter.tokenizer, args.prompt, args.chat)
    cfg = EdgeConfig(
        mode=args.mode, rule=args.rule, k=args.k, policy=args.policy, window=args.window,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed, max_tokens=args.max_tokens,
        connect=ConnectConfig(host=host, port=port, token=token),
    )
    out = TextOutput(drafter.tokenizer, to_stdout=not args.json)
    res = run_edge(drafter if args.mode != "cloud-only" else None, ids, cfg, model_id=drafter.tokenizer.fingerprint, on_tokens=out.push)
    s = res.stats.summary()
    s.update(mode=args.mode, rule=args.rule)
    out.finish(res.tokens, s, as_json=args.json)
    return 0
