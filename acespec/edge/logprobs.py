"""OpenAI's `logprobs` from the cloud's: the target's log-probability of each token it streamed, and the
likeliest alternatives at that position (wire: HELLO.logprobs, TOKENS' HAS_LOGPROBS).

Chat completions ask with `logprobs: true` and `top_logprobs: m` and get `choices[].logprobs.content`, a
list of `{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}`; completions ask with
`logprobs: m` and get `{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}`. A stream
sends each token's entry in the chunk of the round that brought it, so a chunk may carry entries for text
that a stop string still holds back; entries end with the token that completed a stop string, as
`usage.completion_tokens` does.
"""

from __future__ import annotations

from acespec.models.base import Tokenizer


class LogprobLog:
    """The entries of one generation: `take` them as rounds arrive, `pop` what a chunk sends."""

    def __init__(self, tokenizer: Tokenizer, *, chat: bool) -> None:
        self.tokenizer, self.chat = tokenizer, chat
        self.entries: list[tuple[int, float, tuple[tuple[int, float], ...]]] = []  # (token, logprob, top)
        self.sent = 0  # entries already sent
        self.offset = 0  # completions' text_offset of the next entry

    def take(self, tokens: list[int], logprobs) -> None:
        if logprobs is None or len(logprobs) != len(tokens):
            raise RuntimeError("the cloud sent no logprobs for tokens of a session that asked for them")
        self.entries += [(t, lp, top) for t, (lp, top) in zip(tokens, logprobs)]

    def pop(self, limit: int | None = None) -> dict | None:
        """OpenAI's `logprobs` object for the entries not sent yet (at most `limit` in all); None if none."""
        end = len(self.entries) if limit is None else min(limit, len(self.entries))
        new, self.sent = self.entries[self.sent : end], max(self.sent, end)
        return (self._chat(new) if self.chat else self._completion(new)) if new else None

    def _piece(self, token: int) -> tuple[str, bytes]:
        raw = self.tokenizer.decode_bytes([token])
        return raw.decode("utf-8", errors="replace"), raw

    def _chat(self, new) -> dict:
        def one(token: int, lp: float) -> dict:
            text, raw = self._piece(token)
            return {"token": text, "logprob": lp, "bytes": list(raw)}

        return {"content": [one(t, lp) | {"top_logprobs": [one(a, alp) for a, alp in top]} for t, lp, top in new]}

    def _completion(self, new) -> dict:
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, lp, top in new:
            text = self._piece(t)[0]
            out["tokens"].append(text)
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append({self._piece(a)[0]: alp for a, alp in top})
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out
