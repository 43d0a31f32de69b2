"""Token files: the secret an edge presents, and the tenants a cloud admits (`--token-file`).

A cloud's file holds one token per tenant, `name:token` on each line (blank lines and `#` comments are
skipped); a file of one line with no `:` is a single shared token (the tenant `default`). An edge's
file holds its one token.
"""

from __future__ import annotations

from pathlib import Path


def read_token(path: str | None) -> bytes | None:
    if not path:
        return None
    p = Path(path)
    try:
        tok = p.read_bytes().strip()
    except OSError as e:
        raise ValueError(f"cannot read the token file {path}: {e.strerror}") from None
    if not tok:
        raise ValueError(f"the token file {path} is empty")
    return tok


def read_tenants(path: str | None) -> dict[str, bytes] | None:
    """`name:token` lines -> {name: token}; a one-line file without `:` -> {"default": token}."""
    if not path:
        return None
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read the token file {path}: {e.strerror}") from None
    lines = [ln.strip() for ln in raw.splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith(b"#")]
    if not lines:
        raise ValueError(f"the token file {path} is empty")
    if len(lines) == 1 and b":" not in lines[0]:
        return {"default": lines[0]}
    tenants: dict[str, bytes] = {}
    for i, ln in enumerate(lines, 1):
        name, sep, tok = ln.partition(b":")
        name, tok = name.strip(), tok.strip()
        if not sep or not name or not tok:
            raise ValueError(f"the token file {path}: entry {i} must look like name:token")
        try:
            key = name.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"the token file {path}: entry {i} has a tenant name that is not UTF-8") from None
        if key in tenants:
            raise ValueError(f"the token file {path}: tenant {key!r} is listed twice")
        if tok in tenants.values():
            raise ValueError(f"the token file {path}: tenant {key!r} shares its token with another tenant")
        tenants[key] = tok
    return tenants
