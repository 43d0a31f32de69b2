"""The `acespec` command.

Every subcommand reports bad input (unknown model, bad rule spec, bad numbers) as one line
`acespec: error: ...` on stderr with exit status 2, never a traceback. The long-running roles'
flags (`serve`, `edge`, `edge serve`, `demo`) are generated from their settings in `acespec.config`,
which also reads their `--config FILE`; `acespec config show ROLE` prints what a role would run with.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from acespec.argtypes import CliError, nonneg_int, pos_int
from acespec.cli_output import TextOutput, print_stats, prompt_tokens  # noqa: F401  (importable from here, as before)
from acespec.config import OLD_CHOICES, SamplingConfig, add_cli_args, resolve
from acespec.models.registry import DEFAULT_DRAFT, DEFAULT_TARGET

EXIT_USAGE = 2

__all__ = ["main", "build_parser", "CliError", "TextOutput", "print_stats", "prompt_tokens", "EXIT_USAGE"]


# ------------------------------------------------------------------------------------------ helpers
def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--draft",
        default=DEFAULT_DRAFT,
        help=f"drafter model (default {DEFAULT_DRAFT}; a registry name, GGUF path, HF dir or toy:...)",
    )
    p.add_argument("--target", default=DEFAULT_TARGET, help=f"target model (default {DEFAULT_TARGET})")
    p.add_argument("--n-ctx", type=pos_int, default=4096, help="context window for llama.cpp models")


# ------------------------------------------------------------------------------------------ models
def cmd_models(args: argparse.Namespace) -> int:
    from acespec.models import registry

    if args.action == "list":
        rows = registry.list_models()
        if args.json:
            print(json.dumps(rows, indent=2, default=str))
            return 0
        print(f"{'name':24} {'role':8} {'size':>10}  {'status':10} path")
        for r in rows:
            print(f"{r['name']:24} {r['role']:8} {r['size'] / 1e6:8.1f}MB  {r['status']:10} {r['path']}")
        return 0
    if args.action == "export-hf":
        from acespec.models.export import export_hf

        if len(args.names) != 2:
            raise CliError("export-hf takes a model and a new directory: acespec models export-hf NAME DIR")
        export_hf(
            args.names[0],
            args.names[1],
            dtype=args.dtype,
            weights=not args.tokenizer_only,
            say=lambda s: print(s, file=sys.stderr, flush=True),
        )
        print(args.names[1])
        return 0
    names = args.names or [registry.DEFAULT_DRAFT, registry.DEFAULT_TARGET]
    for name in names:
        if args.action == "install":
            path = registry.install(name, progress=not args.quiet, verify=args.verify)
            print(path)
        else:  # path
            found = registry.installed_path(name)  # raises UnknownModelError for a name not in the registry
            if found is None:
                raise registry.NotInstalledError(name, registry.model_path(name))
            print(found)
    return 0


# ------------------------------------------------------------------------------------------ generate
def cmd_generate(args: argparse.Namespace) -> int:
    from acespec.loop import SpecConfig, generate
    from acespec.models import load_model

    sampling: SamplingConfig = resolve(SamplingConfig(), args).config  # checked before loading anything slow
    cfg = SpecConfig(k=args.k, policy=args.policy, spec=not args.no_spec, **sampling.hello_fields())
    target = load_model(args.target, n_ctx=args.n_ctx)
    draft = None if args.no_spec else load_model(args.draft, n_ctx=args.n_ctx)
    ids = prompt_tokens(target.tokenizer, args.prompt, args.chat)
    out = TextOutput(target.tokenizer, to_stdout=not args.json)
    res = generate(target, ids, cfg, draft=draft, on_tokens=out.push)
    summary = res.stats.summary()
    summary.update(
        mode="autoregressive" if args.no_spec else "speculative", rule=str(cfg.rule_spec), k=args.k, policy=args.policy
    )
    out.finish(res.tokens, summary, as_json=args.json)
    return 0


# ------------------------------------------------------------------------------------------ parser
class _ArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line `acespec: error: ...` (exit 2) like every other error.
    Subparsers inherit the class, so every subcommand reports the same way."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(EXIT_USAGE, f"acespec: error: {message} (see `{self.prog} -h`)\n")


def build_parser() -> argparse.ArgumentParser:
    ap = _ArgumentParser(prog="acespec", description="Speculative decoding across an edge device and a cloud GPU.")
    sub = ap.add_subparsers(dest="command", required=True)

    m = sub.add_parser(
        "models",
        help="list, install or locate the registry's models; export one for vLLM",
        description="`export-hf NAME DIR` writes a registry model (or .gguf file) as a Hugging Face "
        "directory, e.g. for `acespec serve --engine vllm --target DIR`.",
    )
    m.add_argument("action", choices=["list", "install", "path", "export-hf"])
    m.add_argument("names", nargs="*", help="registry names (default: the default pair); export-hf: NAME DIR")
    m.add_argument(
        "--dtype", default="bfloat16", help="export-hf: weight dtype (bfloat16, float16, float32; default bfloat16)"
    )
    m.add_argument("--tokenizer-only", action="store_true", help="export-hf: write the tokenizer and config only")
    m.add_argument("--json", action="store_true")
    m.add_argument("--quiet", action="store_true", help="no progress output")
    m.add_argument("--verify", action="store_true", help="re-hash an installed file")
    m.set_defaults(func=cmd_models)

    g = sub.add_parser("generate", help="generate text with speculative decoding (single process)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_model_args(g)
    g.add_argument("--k", type=nonneg_int, default=4, help="draft depth (0: plain steps)")
    g.add_argument(
        "--policy",
        choices=["fixed", "plus2minus1", "controller"],
        type=lambda text: OLD_CHOICES["policy"].get(text, text),
        default="fixed",
        help="draft-depth policy: plus2minus1 is +2 after a whole block taken, -1 otherwise; controller prices K "
        "every round, down to plain steps where no block pays",
    )
    add_cli_args(g, SamplingConfig())
    g.add_argument("--no-spec", action="store_true", help="plain autoregressive decoding with the target (baseline)")
    g.add_argument(
        "--json", action="store_true", help="print one JSON object (text, tokens, stats) instead of streaming"
    )
    g.set_defaults(func=cmd_generate)

    for register in _extra_commands():
        register(sub)
    return ap


def _extra_commands():
    """Subcommands that live next to their layer (bench, eval, serve, edge, wan, demo)."""
    out = []
    for mod, fn in (
        ("acespec.bench.cli", "register"),
        ("acespec.eval.cli", "register"),
        ("acespec.cloud.cli", "register"),
        ("acespec.edge.cli", "register"),
        ("acespec.net.cli", "register"),
        ("acespec.demo", "register"),
        ("acespec.config.cli", "register"),
    ):
        try:
            module = __import__(mod, fromlist=[fn])
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise
            continue
        out.append(getattr(module, fn))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    from acespec.edge.client import EdgeError
    from acespec.models.base import ModelError
    from acespec.models.registry import RegistryError
    from acespec.verify import RuleSpecError

    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (CliError, ModelError, RegistryError, RuleSpecError, EdgeError, ValueError, OSError) as e:
        print(f"acespec: error: {e or type(e).__name__}", file=sys.stderr)  # some errors (timeouts) carry no message
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("acespec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
