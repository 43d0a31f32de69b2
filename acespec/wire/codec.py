"""The byte-level codec of the frames specified in `frames.py`: checked encoding and decoding of one
frame's payload, field by field, and of one whole frame (`encode`, `decode`). The format is the
docstring of `frames.py`; this module only implements it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .errors import ErrorCode, WireError
from .frames import (
    _F32_MAX,
    _U8_MAX,
    _U16_MAX,
    BAD_FRAME,
    DEFAULT_LIMITS,
    LOGPROB_FLOOR,
    MAX_ERROR_MESSAGE_BYTES,
    MAX_SECRET_BYTES,
    MAX_TOP_LOGPROBS,
    OVER_LIMIT,
    Close,
    CloseReason,
    Draft,
    DraftFlag,
    Error,
    Frame,
    FrameType,
    Hello,
    Limits,
    Mode,
    Ping,
    Pong,
    Resume,
    Tokens,
    TokensFlag,
    Verdict,
    VerdictFlag,
    Welcome,
)

__all__ = ["encode", "decode"]


from .fields import _check_version, _enum, _put_uvarint, _Reader, _uint, _varint_size, _Writer

# The flag bits as plain ints: IntFlag arithmetic costs microseconds a frame on the hot path.
_D_Q, _D_TREE = int(DraftFlag.HAS_Q), int(DraftFlag.HAS_TREE)
_V_DROPPED, _V_P, _V_PATH, _V_FINISHED = (
    int(VerdictFlag.DROPPED),
    int(VerdictFlag.HAS_P),
    int(VerdictFlag.HAS_PATH),
    int(VerdictFlag.FINISHED),
)
_T_FINISHED, _T_STEP, _T_LOGPROBS = int(TokensFlag.FINISHED), int(TokensFlag.HAS_STEP), int(TokensFlag.HAS_LOGPROBS)


# One encoder and one decoder per frame type, written side by side so they stay mirror images.


def _enc_hello(w: _Writer, f: Hello) -> None:
    limits = w.limits
    _check_version(_uint(f.version, "HELLO.version", _U8_MAX), "HELLO")
    w.u8(f.version, "HELLO.version")
    w.blob(f.auth, "HELLO.auth", limits.max_str_bytes)
    w.text(f.model_id, "HELLO.model_id", limits.max_str_bytes)
    w.f32(f.temperature, "HELLO.temperature", 0.0, _F32_MAX)
    w.uvarint(f.top_k, "HELLO.top_k")
    w.f32(f.top_p, "HELLO.top_p", 0.0, 1.0)
    w.text(f.rule, "HELLO.rule", limits.max_str_bytes)
    w.u64(f.seed, "HELLO.seed")
    w.u8(_enum(Mode, _uint(f.mode, "HELLO.mode", _U8_MAX), "HELLO.mode"), "HELLO.mode")
    w.uvarint(f.max_tokens, "HELLO.max_tokens")
    w.u8(_hello_logprobs(_uint(f.logprobs, "HELLO.logprobs", _U8_MAX)), "HELLO.logprobs")
    w.tokens(f.prompt, limits.max_prompt_tokens, "HELLO.prompt")


def _hello_logprobs(value: int) -> int:
    if value > MAX_TOP_LOGPROBS + 1:
        raise WireError(BAD_FRAME, f"HELLO.logprobs = {value}: at most 1 + {MAX_TOP_LOGPROBS} alternatives")
    return value


def _dec_hello(r: _Reader) -> Hello:
    limits = r.limits
    version = r.u8("HELLO.version")
    _check_version(version, "HELLO")  # before anything else: the rest of a newer HELLO may differ
    return Hello(
        version=version,
        auth=r.blob("HELLO.auth", limits.max_str_bytes),
        model_id=r.text("HELLO.model_id", limits.max_str_bytes),
        temperature=r.f32("HELLO.temperature", 0.0, _F32_MAX),
        top_k=r.uvarint("HELLO.top_k"),
        top_p=r.f32("HELLO.top_p", 0.0, 1.0),
        rule=r.text("HELLO.rule", limits.max_str_bytes),
        seed=r.u64("HELLO.seed"),
        mode=_enum(Mode, r.u8("HELLO.mode"), "HELLO.mode"),
        max_tokens=r.uvarint("HELLO.max_tokens"),
        logprobs=_hello_logprobs(r.u8("HELLO.logprobs")),
        prompt=r.tokens(limits.max_prompt_tokens, "HELLO.prompt"),
    )


def _enc_welcome(w: _Writer, f: Welcome) -> None:
    w.uvarint(f.session, "WELCOME.session")
    w.uvarint(f.committed, "WELCOME.committed")
    w.uvarint(f.max_draft_tokens, "WELCOME.max_draft_tokens")
    w.blob(f.secret, "WELCOME.secret", MAX_SECRET_BYTES)


def _dec_welcome(r: _Reader) -> Welcome:
    return Welcome(
        session=r.uvarint("WELCOME.session"),
        committed=r.uvarint("WELCOME.committed"),
        max_draft_tokens=r.uvarint("WELCOME.max_draft_tokens"),
        secret=r.blob("WELCOME.secret", MAX_SECRET_BYTES),
    )


def _check_parent(parent: int, i: int) -> None:
    if parent > i:
        raise WireError(BAD_FRAME, f"DRAFT.parents[{i}] = {parent}: must be 0 (the base) or j + 1 for a token j < {i}")


def _enc_draft(w: _Writer, f: Draft) -> None:
    w.uvarint(f.session, "DRAFT.session")
    w.uvarint(f.seq, "DRAFT.seq")
    w.uvarint(f.base, "DRAFT.base")
    n = len(f.tokens)
    w.out.append((_D_Q if f.q is not None else 0) | (_D_TREE if f.parents is not None else 0))
    w.tokens(f.tokens, w.limits.max_draft_tokens, "DRAFT.tokens")
    if f.q is not None:
        if len(f.q) != n:
            raise WireError(BAD_FRAME, f"DRAFT.q has {len(f.q)} rows for {n} tokens")
        for i, row in enumerate(f.q):
            w.row(row, f"DRAFT.q[{i}]")
    if f.parents is not None:
        if len(f.parents) != n:
            raise WireError(BAD_FRAME, f"DRAFT.parents has {len(f.parents)} entries for {n} tokens")
        for i, parent in enumerate(f.parents):
            parent = _uint(parent, f"DRAFT.parents[{i}]")
            _check_parent(parent, i)
            _put_uvarint(w.out, parent)


def _dec_draft(r: _Reader) -> Draft:
    session = r.uvarint("DRAFT.session")
    seq = r.uvarint("DRAFT.seq")
    base = r.uvarint("DRAFT.base")
    flags = r.flags(_D_Q | _D_TREE, "DRAFT.flags")
    tokens = r.tokens(r.limits.max_draft_tokens, "DRAFT.tokens")
    q = parents = None
    if flags & _D_Q:
        q = tuple(r.row(f"DRAFT.q[{i}]") for i in range(len(tokens)))
    if flags & _D_TREE:
        parents = tuple(r.uvarint(f"DRAFT.parents[{i}]") for i in range(len(tokens)))
        for i, parent in enumerate(parents):
            _check_parent(parent, i)
    return Draft(session=session, seq=seq, base=base, tokens=tokens, q=q, parents=parents)


def _check_path(path: tuple[int, ...], accepted: int, limits: Limits) -> None:
    if len(path) != accepted:
        raise WireError(BAD_FRAME, f"VERDICT.path has {len(path)} entries for {accepted} accepted tokens")
    previous = -1
    for index in path:
        if index >= limits.max_draft_tokens:
            raise WireError(OVER_LIMIT, f"VERDICT.path index {index} is beyond max_draft_tokens")
        if index <= previous:
            raise WireError(BAD_FRAME, "VERDICT.path must be strictly increasing (parents precede children)")
        previous = index


def _enc_verdict(w: _Writer, f: Verdict) -> None:
    limits = w.limits
    w.uvarint(f.seq, "VERDICT.seq")
    flags = (
        (_V_DROPPED if f.dropped else 0)
        | (_V_P if f.p is not None else 0)
        | (_V_PATH if f.path is not None else 0)
        | (_V_FINISHED if f.finished else 0)
    )
    w.out.append(flags)
    accepted = _uint(f.accepted, "VERDICT.accepted")
    w.count(accepted, limits.max_draft_tokens, "VERDICT.accepted")
    w.token(f.next_token, "VERDICT.next_token")
    w.uvarint(f.verify_us, "VERDICT.verify_us")
    w.uvarint(f.committed, "VERDICT.committed")
    if f.p is not None:
        w.row(f.p, "VERDICT.p")
    if f.path is not None:
        path = tuple(_uint(index, "VERDICT.path index") for index in f.path)
        _check_path(path, accepted, limits)
        w.count(len(path), limits.max_draft_tokens, "VERDICT.path count")
        for index in path:
            _put_uvarint(w.out, index)


def _dec_verdict(r: _Reader) -> Verdict:
    limits = r.limits
    seq = r.uvarint("VERDICT.seq")
    flags = r.flags(_V_DROPPED | _V_P | _V_PATH | _V_FINISHED, "VERDICT.flags")
    accepted = r.count(limits.max_draft_tokens, "VERDICT.accepted")
    next_token = r.token("VERDICT.next_token")
    verify_us = r.uvarint("VERDICT.verify_us")
    committed = r.uvarint("VERDICT.committed")
    p = r.row("VERDICT.p") if flags & _V_P else None
    path = None
    if flags & _V_PATH:
        n = r.count(limits.max_draft_tokens, "VERDICT.path count")
        path = tuple(r.uvarint("VERDICT.path index") for _ in range(n))
        _check_path(path, accepted, limits)
    return Verdict(
        seq=seq,
        accepted=accepted,
        next_token=next_token,
        verify_us=verify_us,
        committed=committed,
        dropped=bool(flags & _V_DROPPED),
        finished=bool(flags & _V_FINISHED),
        p=p,
        path=path,
    )


def _enc_resume(w: _Writer, f: Resume) -> None:
    _check_version(_uint(f.version, "RESUME.version", _U8_MAX), "RESUME")
    w.u8(f.version, "RESUME.version")
    w.blob(f.auth, "RESUME.auth", w.limits.max_str_bytes)
    w.uvarint(f.session, "RESUME.session")
    w.blob(f.secret, "RESUME.secret", MAX_SECRET_BYTES)
    w.uvarint(f.committed, "RESUME.committed")
    w.blob(f.digest, "RESUME.digest", MAX_SECRET_BYTES)


def _dec_resume(r: _Reader) -> Resume:
    version = r.u8("RESUME.version")
    _check_version(version, "RESUME")
    return Resume(
        version=version,
        auth=r.blob("RESUME.auth", r.limits.max_str_bytes),
        session=r.uvarint("RESUME.session"),
        secret=r.blob("RESUME.secret", MAX_SECRET_BYTES),
        committed=r.uvarint("RESUME.committed"),
        digest=r.blob("RESUME.digest", MAX_SECRET_BYTES),
    )


def _enc_ping(w: _Writer, f: Ping | Pong) -> None:
    w.u64(f.nonce, f"{f.TYPE.name}.nonce")
    w.u64(f.sent_us, f"{f.TYPE.name}.sent_us")


def _dec_ping(r: _Reader) -> Ping:
    return Ping(nonce=r.u64("PING.nonce"), sent_us=r.u64("PING.sent_us"))


def _dec_pong(r: _Reader) -> Pong:
    return Pong(nonce=r.u64("PONG.nonce"), sent_us=r.u64("PONG.sent_us"))


def _message_limit(limits: Limits) -> int:
    return min(MAX_ERROR_MESSAGE_BYTES, limits.max_str_bytes)


def _enc_error(w: _Writer, f: Error) -> None:
    w.u16(_enum(ErrorCode, _uint(f.code, "ERROR.code", _U16_MAX), "ERROR.code"), "ERROR.code")
    if not isinstance(f.message, str):
        raise WireError(BAD_FRAME, f"ERROR.message must be a str, not {type(f.message).__name__}")
    # An error report must not fail for its text: replace what UTF-8 cannot carry, and cut at a
    # character boundary rather than refuse a long message.
    raw = f.message.encode("utf-8", "replace")
    limit = _message_limit(w.limits)
    if len(raw) > limit:
        raw = raw[:limit].decode("utf-8", "ignore").encode("utf-8")
    w.blob(raw, "ERROR.message", limit)


def _dec_error(r: _Reader) -> Error:
    return Error(
        code=_enum(ErrorCode, r.u16("ERROR.code"), "ERROR.code"),
        message=r.text("ERROR.message", _message_limit(r.limits)),
    )


def _enc_close(w: _Writer, f: Close) -> None:
    w.u8(_enum(CloseReason, _uint(f.reason, "CLOSE.reason", _U8_MAX), "CLOSE.reason"), "CLOSE.reason")


def _dec_close(r: _Reader) -> Close:
    return Close(reason=_enum(CloseReason, r.u8("CLOSE.reason"), "CLOSE.reason"))


def _enc_tokens(w: _Writer, f: Tokens) -> None:
    w.uvarint(f.start, "TOKENS.start")
    w.tokens(f.tokens, w.limits.max_prompt_tokens, "TOKENS.tokens")
    step, lps = f.drafted is not None, f.logprobs is not None
    w.out.append((_T_FINISHED if f.finished else 0) | (_T_STEP if step else 0) | (_T_LOGPROBS if lps else 0))
    if step:
        drafted = _uint(f.drafted, "TOKENS.drafted")
        w.count(drafted, w.limits.max_draft_tokens, "TOKENS.drafted")
        if _uint(f.accepted, "TOKENS.accepted") > drafted:
            raise WireError(BAD_FRAME, f"TOKENS.accepted {f.accepted} is more than drafted {drafted}")
        w.uvarint(f.accepted, "TOKENS.accepted")
        w.uvarint(f.verify_us, "TOKENS.verify_us")
    elif f.accepted or f.verify_us:
        raise WireError(BAD_FRAME, "TOKENS.accepted and verify_us need HAS_STEP (drafted set)")
    if lps:
        assert f.logprobs is not None
        if len(f.logprobs) != len(f.tokens):
            raise WireError(BAD_FRAME, f"TOKENS.logprobs has {len(f.logprobs)} entries for {len(f.tokens)} tokens")
        for i, entry in enumerate(f.logprobs):
            if len(entry) != 2:
                raise WireError(BAD_FRAME, f"TOKENS.logprobs[{i}] must be a (logprob, top) pair")
            w.f32(entry[0], f"TOKENS.logprobs[{i}]", LOGPROB_FLOOR, 0.0)
            w.row(entry[1], f"TOKENS.logprobs[{i}].top", limit=MAX_TOP_LOGPROBS, low=LOGPROB_FLOOR, high=0.0)


def _dec_tokens(r: _Reader) -> Tokens:
    start = r.uvarint("TOKENS.start")
    tokens = r.tokens(r.limits.max_prompt_tokens, "TOKENS.tokens")
    flags = r.flags(_T_FINISHED | _T_STEP | _T_LOGPROBS, "TOKENS.flags")
    step: dict = {}
    if flags & _T_STEP:
        drafted = r.count(r.limits.max_draft_tokens, "TOKENS.drafted")
        accepted = r.uvarint("TOKENS.accepted")
        if accepted > drafted:
            raise WireError(BAD_FRAME, f"TOKENS.accepted {accepted} is more than drafted {drafted}")
        step = {"drafted": drafted, "accepted": accepted, "verify_us": r.uvarint("TOKENS.verify_us")}
    if flags & _T_LOGPROBS:
        step["logprobs"] = tuple(
            (
                r.f32(f"TOKENS.logprobs[{i}]", LOGPROB_FLOOR, 0.0),
                r.row(f"TOKENS.logprobs[{i}].top", limit=MAX_TOP_LOGPROBS, low=LOGPROB_FLOOR, high=0.0),
            )
            for i in range(len(tokens))
        )
    return Tokens(start=start, tokens=tokens, finished=bool(flags & _T_FINISHED), **step)


# each encoder takes its own frame type; Any, as one dict cannot say which type goes with which key
_ENCODERS: dict[type, Callable[[_Writer, Any], None]] = {
    Hello: _enc_hello,
    Welcome: _enc_welcome,
    Draft: _enc_draft,
    Verdict: _enc_verdict,
    Resume: _enc_resume,
    Ping: _enc_ping,
    Pong: _enc_ping,
    Error: _enc_error,
    Close: _enc_close,
    Tokens: _enc_tokens,
}

_DECODERS: dict[int, Callable[[_Reader], Frame]] = {
    FrameType.HELLO: _dec_hello,
    FrameType.WELCOME: _dec_welcome,
    FrameType.DRAFT: _dec_draft,
    FrameType.VERDICT: _dec_verdict,
    FrameType.RESUME: _dec_resume,
    FrameType.PING: _dec_ping,
    FrameType.PONG: _dec_pong,
    FrameType.ERROR: _dec_error,
    FrameType.CLOSE: _dec_close,
    FrameType.TOKENS: _dec_tokens,
}


def encode(frame: Frame, limits: Limits = DEFAULT_LIMITS) -> bytes:
    """The complete frame (length prefix, type byte, payload) as bytes.

    Raises WireError for a frame the receiver would refuse under `limits`; TypeError for an object
    that is not a frame at all.
    """
    encoder = _ENCODERS.get(type(frame))
    if encoder is None:
        raise TypeError(f"not a wire frame: {type(frame).__name__}")
    w = _Writer(limits)
    w.out.append(frame.TYPE)
    encoder(w, frame)
    length = len(w.out)
    if length > limits.max_frame_bytes:
        raise WireError(
            OVER_LIMIT, f"{frame.TYPE.name} frame of {length} bytes exceeds max_frame_bytes {limits.max_frame_bytes}"
        )
    prefix = bytearray()
    _put_uvarint(prefix, length)
    return bytes(prefix + w.out)


def _parse_length(buf, pos: int, end: int, max_frame_bytes: int) -> tuple[int, int] | None:
    """(L, prefix size) of the frame at buf[pos:end], or None while the prefix is incomplete.

    Looks at no more bytes than the longest legal prefix, so an oversize frame is refused before any
    of its body is read.
    """
    max_prefix = _varint_size(max_frame_bytes)
    value = 0
    for i in range(min(end - pos, max_prefix)):
        byte = buf[pos + i]
        value |= (byte & 0x7F) << (7 * i)
        if byte < 0x80:
            if byte == 0 and i:
                raise WireError(BAD_FRAME, "frame length prefix is not minimally encoded")
            if value == 0:
                raise WireError(BAD_FRAME, "frame length 0: no type byte")
            if value > max_frame_bytes:
                raise WireError(OVER_LIMIT, f"frame of {value} bytes exceeds max_frame_bytes {max_frame_bytes}")
            return value, i + 1
    if end - pos >= max_prefix:
        raise WireError(
            OVER_LIMIT, f"frame length prefix runs past {max_prefix} bytes: over max_frame_bytes {max_frame_bytes}"
        )
    return None


def _decode_payload(buf, pos: int, end: int, limits: Limits) -> Frame:
    """The frame whose type byte is buf[pos] and whose payload ends at `end`."""
    kind = buf[pos]
    decoder = _DECODERS.get(kind)
    if decoder is None:
        raise WireError(BAD_FRAME, f"unknown frame type {kind}")
    r = _Reader(buf, pos + 1, end, limits)
    frame = decoder(r)
    if r.pos != end:
        raise WireError(BAD_FRAME, f"{end - r.pos} unread bytes at the end of the {frame.TYPE.name} payload")
    return frame


def decode(data: bytes, limits: Limits = DEFAULT_LIMITS) -> Frame:
    """The one frame that `data` holds, from its length prefix to its last byte.

    Raises WireError if `data` is anything else: a partial frame, a frame followed by more bytes,
    or malformed or over-limit content.
    """
    header = _parse_length(data, 0, len(data), limits.max_frame_bytes)
    if header is None:
        raise WireError(BAD_FRAME, "truncated length prefix" if data else "no bytes to decode")
    length, prefix = header
    end = prefix + length
    if len(data) < end:
        raise WireError(BAD_FRAME, f"truncated frame: {len(data) - prefix} of {length} bytes")
    if len(data) > end:
        raise WireError(BAD_FRAME, f"{len(data) - end} trailing bytes after the frame")
    return _decode_payload(data, prefix, end, limits)
