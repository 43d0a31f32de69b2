"""`acespec config`: what a role runs with, and what the environment says.

acespec config show serve --config cloud.yaml --port 7071    # the effective settings, each with its source
acespec config env                                            # the environment variables AceSpec reads
"""

from __future__ import annotations

import argparse

from acespec import env
from acespec.config.roles import ROLES
from acespec.config.schema import add_cli_args, add_config_arg, render_toml, resolve

COMMANDS = {
    "edge": "acespec edge",
    "edge-serve": "acespec edge serve",
    "serve": "acespec serve",
    "demo": "acespec demo",
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config", help="print a role's effective configuration (defaults < --config FILE < flags)")
    what = p.add_subparsers(dest="config_command", required=True)
    show = what.add_parser(
        "show",
        help="the settings a role would run with, as TOML, each with where it came from",
        description="Prints TOML that `--config` reads back: the role's defaults, overlaid with "
        "--config FILE, overlaid with the flags given here.",
    )
    roles = show.add_subparsers(dest="role", required=True, metavar="ROLE")
    for name, cls in ROLES.items():
        r = roles.add_parser(name, help=f"the settings of `{COMMANDS[name]}`")
        add_config_arg(r)
        add_cli_args(r, cls())
        r.set_defaults(func=cmd_show)
    e = what.add_parser("env", help="the environment variables AceSpec reads, and their values here")
    e.set_defaults(func=cmd_env)


def cmd_show(args: argparse.Namespace) -> int:
    resolved = resolve(ROLES[args.role](), args)
    print(render_toml(resolved, COMMANDS[args.role]), end="")
    return 0


def cmd_env(args: argparse.Namespace) -> int:
    for var in env.VARIABLES:
        value = env.raw(var)
        print(f"{var.name:22} {value or '(unset: ' + var.default + ')'}")
        print(f"{'':22} {var.meaning}")
    return 0
