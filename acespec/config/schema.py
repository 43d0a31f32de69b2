"""Configuration dataclasses as command-line flags and as config files.

A role's configuration is a frozen dataclass whose fields carry a one-line comment (nanoGPT's
GPTConfig style); that comment is the flag's help. `add_cli_args` turns every field into a flag named
after it (`max_tokens` -> `--max-tokens`; a nested dataclass field's own fields are flags too, flat);
`resolve` layers the three sources, defaults < `--config FILE` < flags given on the command line, and
builds the dataclass, whose `__post_init__` is the one place a value is checked. `render_toml` prints
the result with each value's source, as a file `--config` reads back.

The flags are added with `default=argparse.SUPPRESS`, so the parsed namespace holds only the flags the
command line gave: that is how a flag is told apart from a default that happens to equal it.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import functools
import inspect
import io
import json
import math
import textwrap
import tokenize
import tomllib
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

SOURCE_DEFAULT = "default"
SOURCE_FLAG = "flag"


class ConfigError(ValueError):
    """A setting that cannot be used. `key` is the field it is about (None: several); the message's
    `{key}` is written as the flag (`--top-p`) or, for a value from a file, as the file's key."""

    def __init__(self, key: str | None, message: str) -> None:
        self.key = key
        self.message = message
        super().__init__(self.render())

    def render(self, file: str | None = None) -> str:
        if self.key is None:
            return self.message + (f" (with the settings of {file})" if file else "")
        name = f"{self.key.replace('_', '-')} in {file}" if file else "--" + self.key.replace("_", "-")
        return self.message.replace("{key}", name)


# ------------------------------------------------------------------------------------------ checks
def check(key: str, ok: bool, value: Any, must: str) -> None:
    """Raise "{key} must <must>, got <value>" unless `ok`. (`not x >= 0` refuses nan too: write conditions so.)"""
    if not ok:
        raise ConfigError(key, f"{{key}} must {must}, got {value!r}")


def at_least(key: str, value: int | float | None, low: float) -> None:
    if value is not None:
        check(key, value >= low, value, f"be >= {low:g}")


def in_range(key: str, value: int | None, low: int, high: int) -> None:
    if value is not None:
        check(key, low <= value <= high, value, f"be in {low}..{high}")


def seconds(key: str, value: float) -> None:
    """A timeout: finite and > 0."""
    check(key, 0 < value < math.inf, value, "be a positive number of seconds")


# ------------------------------------------------------------------------------------------ fields
@dataclass(frozen=True)
class Leaf:
    """One setting: a field of the role's dataclass or of one nested in it."""

    name: str  # the field's name, unique in its role
    base: type  # bool, int, float or str
    optional: bool  # None is a value (unset)
    choices: tuple[str, ...] | None  # a Literal's values
    default: Any  # the role's default
    doc: str  # the field's comment

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """{field: the comment on its line} for a dataclass and the dataclasses it derives from."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        src = textwrap.dedent(inspect.getsource(klass))
        comments = {
            t.start[0]: t.string.lstrip("#").strip()
            for t in tokenize.generate_tokens(io.StringIO(src).readline)
            if t.type == tokenize.COMMENT
        }
        (node,) = ast.parse(src).body
        for stmt in node.body:  # type: ignore[attr-defined]
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                doc = comments.get(stmt.end_lineno or stmt.lineno) or comments.get(stmt.lineno)
                if doc:
                    docs[stmt.target.id] = doc
    return docs


def _leaf_type(hint: Any) -> tuple[type, bool, tuple[str, ...] | None]:
    optional = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(args) < len(typing.get_args(hint))
        (hint,) = args
    if typing.get_origin(hint) is Literal:
        return str, optional, tuple(typing.get_args(hint))
    if hint not in (bool, int, float, str):
        raise TypeError(f"a config field must be bool, int, float, str or a Literal of str, not {hint!r}")
    return hint, optional, None


def leaves(instance: Any) -> list[Leaf]:
    """The settings of a role instance, nested dataclasses flattened, in declaration order, less the
    role's `omit` (fields that role does not use). The instance's values are the defaults."""
    omit: frozenset[str] = getattr(type(instance), "omit", frozenset())
    out: list[Leaf] = []
    for obj in _dataclass_tree(instance):
        cls: type = type(obj)
        hints, docs = typing.get_type_hints(cls), field_docs(cls)
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value) or f.name in omit:
                continue
            base, optional, choices = _leaf_type(hints[f.name])
            out.append(Leaf(f.name, base, optional, choices, value, docs.get(f.name, "")))
    names = [leaf.name for leaf in out]
    dupes = {n for n in names if names.count(n) > 1}
    if dupes:
        raise TypeError(f"{type(instance).__name__}: settings named twice: {sorted(dupes)}")
    return out


def _dataclass_tree(obj: Any) -> list[Any]:
    out = [obj]
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out.extend(_dataclass_tree(value))
    return out


def replace_flat(instance: Any, values: dict[str, Any]) -> Any:
    """A copy of the role with the flat {setting: value} applied, nested dataclasses included;
    building it runs every `__post_init__`, i.e. every check."""
    changes = {}
    for f in dataclasses.fields(instance):
        value = getattr(instance, f.name)
        if dataclasses.is_dataclass(value):
            changes[f.name] = replace_flat(value, values)
        elif f.name in values:
            changes[f.name] = values[f.name]
    return dataclasses.replace(instance, **changes)


def flat(instance: Any) -> dict[str, Any]:
    """{setting: value} of a role, flat, as the command line and config files name them."""
    return {leaf.name: leaf.default for leaf in leaves(instance)}


# ------------------------------------------------------------------------------------------ command line
def _parse_int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def _parse_float(text: str) -> float:
    try:
        return float(text)  # inf and nan too: the field's check decides what it takes
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


_PARSERS: dict[type, Callable[[str], Any]] = {int: _parse_int, float: _parse_float, str: str}

# a choice that was renamed: its old spelling is still taken, on the command line and in a file, and
# read as the new one (docs/operate/configuration.md, release notes); help and `config show` give the new
OLD_CHOICES: dict[str, dict[str, str]] = {"policy": {"adaptive": "plus2minus1"}}


def _parser(leaf: Leaf) -> Callable[[str], Any]:
    old = OLD_CHOICES.get(leaf.name)
    if old is None:
        return _PARSERS[leaf.base]
    return lambda text: old.get(text, text)


_METAVARS = {int: "N", float: "X", str: "TEXT"}
_PATH_SUFFIXES = ("_file", "_ca", "_cert", "_key")  # settings that name a file


def _show(value: Any) -> str:
    if isinstance(value, float):
        return "inf" if value == math.inf else f"{value:g}"
    return str(value)


def add_cli_args(parser: argparse.ArgumentParser, instance: Any) -> None:
    """A flag for every setting of the role `instance` (whose values are the defaults shown)."""
    for leaf in leaves(instance):
        help_text = leaf.doc
        if leaf.base is bool:
            help_text += " (on by default)" if leaf.default else ""
            parser.add_argument(
                leaf.flag,
                dest=leaf.name,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=help_text,
            )
            continue
        if leaf.default is not None:
            help_text += f" (default {_show(leaf.default)})"
        parser.add_argument(
            leaf.flag,
            dest=leaf.name,
            type=_parser(leaf),
            choices=leaf.choices,
            default=argparse.SUPPRESS,
            help=help_text,
            metavar=None if leaf.choices else "PATH" if leaf.name.endswith(_PATH_SUFFIXES) else _METAVARS[leaf.base],
        )


def add_config_arg(parser: argparse.ArgumentParser) -> None:
    # SUPPRESS, as for the settings: `acespec edge --config F serve` keeps F (a subcommand's own default
    # would overwrite what its parent parsed)
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=argparse.SUPPRESS,
        help="settings from a YAML (.yaml, .yml) or TOML (.toml) file, keys named as the flags; "
        "a flag given here wins over the file",
    )


# ------------------------------------------------------------------------------------------ files
def read_file(path: str) -> dict[str, Any]:
    """The top-level table of a YAML or TOML file."""
    suffix = Path(path).suffix.lower()
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(None, f"cannot read the config file {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(None, f"the config file {path} is not UTF-8 text") from None
    try:
        if suffix == ".toml":
            data = tomllib.loads(text)
        elif suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text)
        else:
            raise ConfigError(None, f"the config file {path} must end in .toml, .yaml or .yml")
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as e:
        raise ConfigError(
            None, f"the config file {path} is not valid {suffix[1:].upper()}: {' '.join(str(e).split())}"
        ) from None
    if data is None:  # an empty YAML file
        return {}
    if not isinstance(data, dict):
        raise ConfigError(None, f"the config file {path} must hold a table of settings, not a {type(data).__name__}")
    return data


def _coerce(leaf: Leaf, key: str, value: Any, path: str) -> Any:
    where = f"{key} in {path}"
    if value is None:
        if leaf.optional:
            return None
        raise ConfigError(None, f"{where} must be set to a value, not left empty")
    if leaf.base is bool:
        ok = isinstance(value, bool)
    elif leaf.base is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif leaf.base is float:
        if isinstance(value, str) and value.strip().lower() in ("inf", "+inf", "infinity"):
            value = math.inf
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    else:
        ok = isinstance(value, str)
    if not ok:
        kind = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[leaf.base]
        raise ConfigError(None, f"{where} must be {kind}, not {value!r}")
    value = OLD_CHOICES.get(leaf.name, {}).get(value, value) if isinstance(value, str) else value
    if leaf.choices is not None and value not in leaf.choices:
        raise ConfigError(None, f"{where} must be one of {', '.join(leaf.choices)}, not {value!r}")
    return value


def file_settings(instance: Any, path: str) -> dict[str, Any]:
    """{setting: value} from a config file, each key known to the role and each value of its type."""
    by_name = {leaf.name: leaf for leaf in leaves(instance)}
    out: dict[str, Any] = {}
    for key, value in read_file(path).items():
        name = str(key).replace("-", "_")
        leaf = by_name.get(name)
        if leaf is None or not isinstance(key, str):
            close = difflib.get_close_matches(name, list(by_name), n=1)
            hint = f"did you mean {close[0].replace('_', '-')!r}? " if close else ""
            raise ConfigError(
                None, f"unknown key {key!r} in {path} ({hint}`acespec config show ROLE` lists every key a role takes)"
            )
        if name in out:
            raise ConfigError(None, f"{path} sets {name} twice (as - and _)")
        out[name] = _coerce(leaf, key, value, path)
    return out


# ------------------------------------------------------------------------------------------ layering
@dataclass(frozen=True)
class Resolved:
    config: Any  # the role's dataclass, checked
    sources: dict[str, str]  # setting -> default | file PATH | flag


def resolve(instance: Any, args: argparse.Namespace) -> Resolved:
    """The role `instance` (its defaults) overlaid with `--config FILE` and then with the flags given."""
    path = getattr(args, "config", None)
    values: dict[str, Any] = {}
    sources = {leaf.name: SOURCE_DEFAULT for leaf in leaves(instance)}
    if path:
        for name, value in file_settings(instance, path).items():
            values[name], sources[name] = value, f"file {path}"
    for name in sources:
        if hasattr(args, name):
            values[name], sources[name] = getattr(args, name), SOURCE_FLAG
    try:
        cfg = replace_flat(instance, values)
    except ConfigError as e:
        from_file = e.key is not None and sources.get(e.key, "").startswith("file ")
        raise ConfigError(None, e.render(path if from_file or (e.key is None and path) else None)) from None
    return Resolved(cfg, sources)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return repr(value) if math.isfinite(value) else "inf" if value > 0 else "-inf"
    if isinstance(value, int):
        return str(value)
    return json.dumps(value, ensure_ascii=False)  # a JSON string is a TOML basic string


def render_toml(resolved: Resolved, title: str) -> str:
    """The effective configuration as TOML, each value's source in a comment (unset values commented out)."""
    lines = [f"# {title}: the effective configuration; each line says where its value came from", ""]
    for leaf in leaves(resolved.config):
        key = leaf.name.replace("_", "-")
        src = resolved.sources.get(leaf.name, SOURCE_DEFAULT)
        text = f"# {key} = (unset)" if leaf.default is None else f"{key} = {_toml_value(leaf.default)}"
        lines.append(f"{text:<48} # {src}")
    return "\n".join(lines) + "\n"
