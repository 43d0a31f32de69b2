"""The documentation stays a front door: a short README that keeps CI's two commands, and no file that
points outside the repository. (`scripts/docs.sh` checks the site itself: `mkdocs build --strict` fails on
a broken link, an anchor that is not there, or a page missing from the nav.)"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OUTSIDE = "../" + "shared"  # spelled in two parts, so this file does not match its own search


def _tracked_text_files() -> list[Path]:
    if not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout (it reads the files git tracks)")
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    return [ROOT / n for n in names if n and (ROOT / n).is_file()]


def test_no_file_in_the_repository_refers_to_a_path_outside_it():
    offenders = []
    for path in _tracked_text_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary files (models' test data, images) hold no references
        if OUTSIDE in text:
            offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []


def test_the_readme_is_short_and_gives_the_commands_ci_runs():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 150
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    for command in ("bash scripts/demo.sh", "bash scripts/test.sh"):
        assert command in ci and command in text, command


def test_every_relative_link_in_the_readme_reaches_a_file():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    links = [m.group(1).split("#")[0] for m in re.finditer(r"\]\(([^)\s]+)\)", text)]
    missing = [link for link in links if link and "://" not in link and not (ROOT / link).exists()]
    assert links and missing == []
