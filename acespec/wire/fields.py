"""The field-level checks under the codec (`codec.py`): the Python values a frame may carry, checked on the
way out (`_Writer`), and the bytes of a payload read and checked field by field on the way in (`_Reader`).
Each check fails with the WireError code the receiver would answer with. The format is the docstring of
`frames.py`.
"""

from __future__ import annotations

import numbers
import operator

from .errors import ErrorCode, WireError
from .frames import (
    _F32,
    _U8_MAX,
    _U16,
    _U16_MAX,
    _U64,
    _U64_MAX,
    BAD_FRAME,
    OVER_LIMIT,
    PROTOCOL_VERSION,
    Limits,
    SparseRow,
)

# Checking Python values on the way out. Failures are WireErrors with the code the receiver would
# use, so a sender learns about a bad frame before it costs a round trip.


def _uint(value, what: str, max_value: int = _U64_MAX) -> int:
    if type(value) is not int:
        try:
            value = operator.index(value)  # accepts numpy integers
        except TypeError:
            raise WireError(BAD_FRAME, f"{what} must be an integer, not {type(value).__name__}") from None
    if value < 0 or value > max_value:
        raise WireError(BAD_FRAME, f"{what} = {value} is outside 0..{max_value}")
    return value


def _float(value, what: str, low: float, high: float) -> float:
    if type(value) is not float:
        if not isinstance(value, numbers.Real):
            raise WireError(BAD_FRAME, f"{what} must be a real number, not {type(value).__name__}")
        value = float(value)
    if not low <= value <= high:  # false for NaN too
        raise WireError(BAD_FRAME, f"{what} = {value!r} is outside {low}..{high}")
    return value


def _enum(enum_type, value, what: str):
    try:
        return enum_type(value)
    except ValueError:
        raise WireError(BAD_FRAME, f"unknown {what} {value}") from None


def _check_version(version: int, what: str) -> None:
    if version != PROTOCOL_VERSION:
        raise WireError(
            ErrorCode.BAD_VERSION,
            f"{what} speaks protocol version {version}; this peer speaks {PROTOCOL_VERSION}",
        )


def _varint_size(value: int) -> int:
    return max(1, (value.bit_length() + 6) // 7)


def _put_uvarint(out: bytearray, value: int) -> None:
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


class _Writer:
    """Appends checked fields to a payload; mirrors `_Reader` check for check."""

    __slots__ = ("out", "limits")

    def __init__(self, limits: Limits):
        self.out = bytearray()
        self.limits = limits

    def u8(self, value, what):
        self.out.append(_uint(value, what, _U8_MAX))

    def u16(self, value, what):
        self.out += _U16.pack(_uint(value, what, _U16_MAX))

    def u64(self, value, what):
        self.out += _U64.pack(_uint(value, what))

    def uvarint(self, value, what):
        _put_uvarint(self.out, _uint(value, what))

    def count(self, n: int, limit: int, what):
        if n > limit:
            raise WireError(OVER_LIMIT, f"{what}: {n} exceeds the limit of {limit}")
        _put_uvarint(self.out, n)

    def token(self, value, what):
        value = _uint(value, what)
        if value >= self.limits.max_vocab:
            raise WireError(OVER_LIMIT, f"{what} = {value} is not below max_vocab {self.limits.max_vocab}")
        _put_uvarint(self.out, value)

    def tokens(self, values, limit: int, what):
        self.count(len(values), limit, f"{what} count")
        out, vocab = self.out, self.limits.max_vocab
        for value in values:
            if type(value) is not int or not 0 <= value < vocab:
                self.token(value, f"{what} id")  # the slow path: converts, or raises the right error
                continue
            while value >= 0x80:
                out.append((value & 0x7F) | 0x80)
                value >>= 7
            out.append(value)

    def f32(self, value, what, low, high):
        self.out += _F32.pack(_float(value, what, low, high))

    def blob(self, value, what, max_bytes: int):
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise WireError(BAD_FRAME, f"{what} must be bytes, not {type(value).__name__}")
        value = bytes(value)
        self.count(len(value), max_bytes, f"{what} length")
        self.out += value

    def text(self, value, what, max_bytes: int):
        if not isinstance(value, str):
            raise WireError(BAD_FRAME, f"{what} must be a str, not {type(value).__name__}")
        try:
            raw = value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise WireError(BAD_FRAME, f"{what} is not valid Unicode: {exc.reason}") from None
        self.blob(raw, what, max_bytes)

    def row(self, row, what, *, limit: int | None = None, low: float = 0.0, high: float = 1.0):
        """A sparse row; its floats are probabilities (0..1) unless `low`/`high` say otherwise (an lrow)."""
        self.count(len(row), self.limits.max_sparse_k if limit is None else limit, f"{what} size")
        seen = set()
        for pair in row:
            if len(pair) != 2:
                raise WireError(BAD_FRAME, f"{what} entries must be (token, value) pairs")
            token, prob = pair
            self.token(token, f"{what} token")
            if token in seen:
                raise WireError(BAD_FRAME, f"{what} lists token {token} twice")
            seen.add(token)
            self.f32(prob, f"{what} value", low, high)


class _Reader:
    """Reads fields from buf[pos:end]; every shortfall or bad value is a WireError."""

    __slots__ = ("buf", "pos", "end", "limits")

    def __init__(self, buf, pos: int, end: int, limits: Limits):
        self.buf = buf
        self.pos = pos
        self.end = end
        self.limits = limits

    def _take(self, n: int, what) -> int:
        pos = self.pos
        if pos + n > self.end:
            raise WireError(BAD_FRAME, f"truncated {what}: needs {n} bytes, {self.end - pos} left")
        self.pos = pos + n
        return pos

    def u8(self, what) -> int:
        return self.buf[self._take(1, what)]

    def u16(self, what) -> int:
        return _U16.unpack_from(self.buf, self._take(2, what))[0]

    def u64(self, what) -> int:
        return _U64.unpack_from(self.buf, self._take(8, what))[0]

    def uvarint(self, what) -> int:
        buf, pos, end = self.buf, self.pos, self.end
        if pos < end and buf[pos] < 0x80:  # most varints on the wire are one byte
            self.pos = pos + 1
            return buf[pos]
        value = shift = 0
        while True:
            if pos >= end:
                raise WireError(BAD_FRAME, f"truncated varint in {what}")
            byte = buf[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            if byte < 0x80:
                break
            shift += 7
            if shift == 70:
                raise WireError(BAD_FRAME, f"varint in {what} is longer than 10 bytes")
        if byte == 0:
            raise WireError(BAD_FRAME, f"varint in {what} is not minimally encoded")
        if value > _U64_MAX:
            raise WireError(BAD_FRAME, f"varint in {what} overflows 64 bits")
        self.pos = pos
        return value

    def count(self, limit: int, what) -> int:
        n = self.uvarint(what)
        if n > limit:
            raise WireError(OVER_LIMIT, f"{what}: {n} exceeds the limit of {limit}")
        return n

    def token(self, what) -> int:
        value = self.uvarint(what)
        if value >= self.limits.max_vocab:
            raise WireError(OVER_LIMIT, f"{what} = {value} is not below max_vocab {self.limits.max_vocab}")
        return value

    def tokens(self, limit: int, what) -> tuple[int, ...]:
        n = self.count(limit, f"{what} count")
        vocab, out = self.limits.max_vocab, []
        for _ in range(n):  # token() inlined, its message built only on failure: this runs for every id on the wire
            value = self.uvarint(what)
            if value >= vocab:
                raise WireError(OVER_LIMIT, f"{what} id = {value} is not below max_vocab {vocab}")
            out.append(value)
        return tuple(out)

    def f32(self, what, low, high) -> float:
        value = _F32.unpack_from(self.buf, self._take(4, what))[0]
        if not low <= value <= high:  # false for NaN too
            raise WireError(BAD_FRAME, f"{what} = {value!r} is outside {low}..{high}")
        return value

    def blob(self, what, max_bytes: int) -> bytes:
        n = self.count(max_bytes, f"{what} length")
        start = self._take(n, what)
        return bytes(self.buf[start : start + n])

    def text(self, what, max_bytes: int) -> str:
        raw = self.blob(what, max_bytes)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise WireError(BAD_FRAME, f"{what} is not valid UTF-8: {exc.reason}") from None

    def row(self, what, *, limit: int | None = None, low: float = 0.0, high: float = 1.0) -> SparseRow:
        n = self.count(self.limits.max_sparse_k if limit is None else limit, f"{what} size")
        pairs = tuple((self.token(f"{what} token"), self.f32(f"{what} value", low, high)) for _ in range(n))
        if len({token for token, _ in pairs}) != n:
            raise WireError(BAD_FRAME, f"{what} lists a token twice")
        return pairs

    def flags(self, known: int, what) -> int:
        flags = self.u8(what)
        if flags & ~int(known):  # int(): ~ on an IntFlag inverts only its defined bits, giving 0
            raise WireError(BAD_FRAME, f"{what} has reserved bits set: {flags:#04x}")
        return flags
