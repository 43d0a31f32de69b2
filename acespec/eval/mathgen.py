"""Verifiable arithmetic word problems, generated in code from a seed, with known integer answers.

Problem `i` of seed `s` depends only on `(s, i)`, so the first `n` problems of a larger set are the
same `n` problems (a resumed run that raises `--n` keeps its earlier prompts). Every problem takes two
or three arithmetic steps, has a positive integer answer, and the answer is never one of the numbers
stated in the problem (so "the answer appears in the output" is not satisfied by quoting the problem).

The prompt states the answer format, `Answer: <integer>`; `parse_answer` reads the last such line
(tolerating bold, a dollar sign, thousands separators, and falling back to `\\boxed{n}`).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

ANSWER_FORMAT = 'End your reply with a final line of the form "Answer: <integer>".'

_NAMES = [
    "Ava",
    "Ben",
    "Chloe",
    "Daniel",
    "Emma",
    "Farid",
    "Grace",
    "Hugo",
    "Iris",
    "Jonas",
    "Keiko",
    "Liam",
    "Maya",
    "Noah",
    "Olga",
    "Priya",
    "Quinn",
    "Rosa",
    "Sami",
    "Tara",
]
_PRONOUN = {
    n: (
        "she"
        if n in {"Ava", "Chloe", "Emma", "Grace", "Iris", "Keiko", "Maya", "Olga", "Priya", "Rosa", "Tara"}
        else "he"
    )
    for n in _NAMES
}
_ITEMS = ["apples", "marbles", "stickers", "pencils", "cookies", "stamps", "shells", "cards"]


@dataclass(frozen=True)
class MathProblem:
    id: str  # "math/<seed>/<index>"
    question: str
    answer: int
    numbers: tuple[int, ...]  # the quantities stated in the question

    @property
    def prompt(self) -> str:
        return f"{self.question}\n\nSolve the problem step by step. {ANSWER_FORMAT}"


def _t_buy_give(r: random.Random):
    name, item = r.choice(_NAMES), r.choice(_ITEMS)
    a, b, c = r.randint(5, 60), r.randint(2, 9), r.randint(3, 12)
    d = r.randint(1, a + b * c - 1)
    q = (
        f"{name} has {a} {item}. {_PRONOUN[name].capitalize()} buys {b} packs with {c} {item} in each pack, "
        f"then gives {d} {item} to a friend. How many {item} does {name} have now?"
    )
    return q, a + b * c - d, (a, b, c, d)


def _t_bakery(r: random.Random):
    item = r.choice(["muffins", "rolls", "cookies", "buns"])
    a, b = r.randint(3, 15), r.randint(6, 24)
    c = r.randint(1, a * b // 2)
    d = r.randint(1, a * b - c - 1)
    q = (
        f"A bakery bakes {a} trays of {item} with {b} {item} on each tray. It sells {c} {item} in the morning "
        f"and {d} in the afternoon. How many {item} are left at the end of the day?"
    )
    return q, a * b - c - d, (a, b, c, d)


def _t_pages(r: random.Random):
    name = r.choice(_NAMES)
    a, b, c, d = r.randint(5, 30), r.randint(2, 9), r.randint(5, 30), r.randint(2, 9)
    e = a * b + c * d + r.randint(5, 200)
    q = (
        f"{name} reads {a} pages a day for {b} days, then {c} pages a day for {d} days. The book has {e} pages. "
        f"How many pages are left to read?"
    )
    return q, e - (a * b + c * d), (a, b, c, d, e)


def _t_change(r: random.Random):
    name = r.choice(_NAMES)
    a, b, c, d = r.randint(2, 9), r.randint(3, 15), r.randint(2, 8), r.randint(1, 6)
    cost = a * c + b * d
    e = next(x for x in (20, 50, 100, 200, 500) if x > cost)
    q = (
        f"A shop sells pens for {a} dollars each and notebooks for {b} dollars each. {name} buys {c} pens and "
        f"{d} notebooks and pays with a {e}-dollar bill. How many dollars of change does {name} get?"
    )
    return q, e - cost, (a, b, c, d, e)


def _t_rows(r: random.Random):
    d = r.randint(3, 9)
    rows = r.randint(3, 20)
    a = r.randint(3, 12)
    present = d * rows
    b = r.randint(present // a + 1, present // a + 15)
    c = a * b - present
    q = (
        f"A school has {a} classes with {b} students each. On Monday {c} students are absent. The students who "
        f"are present sit in rows of {d}, and every row is full. How many rows are there?"
    )
    return q, rows, (a, b, c, d)


def _t_train(r: random.Random):
    a, b, c, d = r.randint(40, 120), r.randint(2, 6), r.randint(40, 120), r.randint(2, 6)
    q = (
        f"A train travels at {a} kilometres per hour for {b} hours, then at {c} kilometres per hour for {d} "
        f"hours. How many kilometres does it travel in total?"
    )
    return q, a * b + c * d, (a, b, c, d)


def _t_savings(r: random.Random):
    name = r.choice(_NAMES)
    a, b, c = r.randint(10, 200), r.randint(3, 25), r.randint(2, 12)
    d = r.randint(1, a + b * c - 1)
    q = (
        f"{name} has saved {a} dollars. {_PRONOUN[name].capitalize()} saves {b} dollars every week for {c} weeks, "
        f"then spends {d} dollars on a present. How many dollars does {name} have left?"
    )
    return q, a + b * c - d, (a, b, c, d)


_TEMPLATES = [_t_buy_give, _t_bakery, _t_pages, _t_change, _t_rows, _t_train, _t_savings]


def make_problem(seed: int, index: int) -> MathProblem:
    """Problem `index` of the set with this seed; depends on (seed, index) only."""
    r = random.Random(f"acespec-math:{int(seed)}:{int(index)}")
    while True:
        question, answer, numbers = r.choice(_TEMPLATES)(r)
        if answer > 0 and answer not in numbers:
            return MathProblem(f"math/{seed}/{index}", question, int(answer), tuple(int(x) for x in numbers))


def make_problems(n: int, seed: int = 0) -> list[MathProblem]:
    return [make_problem(seed, i) for i in range(int(n))]


_INT = r"(-?\d{1,3}(?:,\d{3})+|-?\d+)"
_ANSWER_STRICT_RE = re.compile(r"answer\s*\**\s*[:=]\s*\**\s*\$?\s*" + _INT + r"(?!\.?\d)", re.IGNORECASE)
_BOXED_RE = re.compile(r"\\boxed\{\s*\$?\s*" + _INT + r"\s*\}")


def parse_answer(text: str) -> int | None:
    """The integer after the last `Answer:` (the stated format); else the last `\\boxed{n}`; else None."""
    m = _ANSWER_STRICT_RE.findall(text)
    if not m:
        m = _BOXED_RE.findall(text)
    if not m:
        return None
    try:
        return int(m[-1].replace(",", ""))
    except ValueError:  # pragma: no cover - the regex only matches integers
        return None


def answer_pattern(answer: int) -> re.Pattern[bytes]:
    """A bytes regex matching `answer` as a whole number (not inside 1234 or 12.5); commas allowed."""
    digits = str(abs(int(answer)))
    grouped = f"{abs(int(answer)):,}"
    alts = [re.escape(digits)] + ([re.escape(grouped)] if grouped != digits else [])
    sign = "-" if answer < 0 else ""
    body = sign + "(?:" + "|".join(alts) + ")"
    return re.compile(rb"(?<![\d.,])" + body.encode() + rb"(?!,?\d|\.\d)")


def first_answer_end(output: bytes, answer: int) -> int | None:
    """Byte offset just past the first occurrence of the correct answer in `output`, or None."""
    m = answer_pattern(answer).search(output)
    return None if m is None else m.end()
