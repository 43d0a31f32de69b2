"""One configuration for AceSpec's long-running roles: dataclasses whose fields are the flags, the
`--config FILE` keys and what `acespec config show` prints (see docs/operate/configuration.md).

`roles` declares the settings, `schema` turns them into flags and reads config files, `tokens` reads
token files. Environment variables are read in `acespec.env`.
"""

from acespec.config.roles import (
    ROLES,
    CloudRole,
    DemoRole,
    EdgeOptions,
    EdgeRole,
    EdgeServeRole,
    SamplingConfig,
    parse_fleet,
    parse_hostport,
)
from acespec.config.schema import (
    OLD_CHOICES,
    ConfigError,
    Resolved,
    add_cli_args,
    add_config_arg,
    render_toml,
    resolve,
)

__all__ = [
    "ROLES",
    "CloudRole",
    "DemoRole",
    "EdgeOptions",
    "EdgeRole",
    "EdgeServeRole",
    "SamplingConfig",
    "parse_fleet",
    "parse_hostport",
    "OLD_CHOICES",
    "ConfigError",
    "Resolved",
    "add_cli_args",
    "add_config_arg",
    "render_toml",
    "resolve",
]
