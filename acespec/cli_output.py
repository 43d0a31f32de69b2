"""What the generating commands (`acespec generate`, `acespec edge`) print: the text as it streams,
then the statistics, or one JSON object."""

from __future__ import annotations

import json
import sys

from acespec.argtypes import CliError
from acespec.models import TextStream


def prompt_tokens(tokenizer, text: str, chat: bool) -> list[int]:
    if chat:
        ids = tokenizer.chat_prompt([{"role": "user", "content": text}])
    else:
        ids = tokenizer.encode(text)
    if not ids:
        raise CliError("the prompt is empty after tokenization")
    return ids


class TextOutput:
    """Streams generated text to stdout as tokens commit, then prints the statistics (or one JSON object)."""

    def __init__(self, tokenizer, *, to_stdout: bool) -> None:
        self.stream = TextStream(tokenizer)
        self.pieces: list[str] = []
        self.to_stdout = to_stdout

    def push(self, toks: list[int]) -> None:
        text = self.stream.push(toks)
        self.pieces.append(text)
        if self.to_stdout:
            sys.stdout.write(text)
            sys.stdout.flush()

    def finish(self, tokens: list[int], summary: dict, *, as_json: bool, error: dict | None = None) -> None:
        tail = self.stream.flush()
        self.pieces.append(tail)
        if as_json:
            obj = {"text": "".join(self.pieces), "tokens": tokens, "stats": summary}
            if error is not None:
                obj["error"] = error  # the run failed; text and tokens are what was committed before it did
            print(json.dumps(obj), flush=True)
        else:
            sys.stdout.write(tail + "\n")
            print_stats(summary, sys.stderr)


def print_stats(s: dict, out) -> None:
    keys = [
        ("mode", "mode"),
        ("rule", "rule"),
        ("emitted", "tokens"),
        ("tokens_per_s", "tokens/s"),
        ("rounds", "rounds"),
        ("drafted", "drafted"),
        ("accepted", "accepted"),
        ("mean_acceptance_length", "mean acceptance length"),
        ("acceptance_rate", "acceptance rate"),
        ("target_passes_per_token", "target passes/token"),
        ("draft_s", "draft s"),
        ("verify_s", "verify s"),
        ("wall_s", "wall s"),
        ("ttft_s", "time to first token s"),
    ]
    out.write("--- stats ---\n")
    for k, label in keys:
        if k in s:
            out.write(f"{label:>24}: {s[k]}\n")
    if s.get("per_position_acceptance"):
        out.write(f"{'per-position acceptance':>24}: {s['per_position_acceptance']}\n")
