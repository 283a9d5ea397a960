"""Where every benchmark's results go: NAME.json and NAME.md in the output folder, and its docs section (between
`<!-- bench:SECTION:start -->` and `<!-- bench:SECTION:end -->` in docs/benchmarks.md, replaced in place)."""

from __future__ import annotations

import datetime
import functools
import os
import platform
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import orjson

import kvgate


class BadOption(ValueError):
    """A scenario's option that makes no sense; `kvgate bench` prints it and exits 2."""


def markers(section: str) -> tuple[str, str]:
    """The start and end markers of `section`: `<!-- bench:SECTION:start -->` and `<!-- bench:SECTION:end -->`."""
    return f"<!-- bench:{section}:start -->", f"<!-- bench:{section}:end -->"


def write_docs_section(path: Path, section: str, markdown: str) -> None:
    """Replace the text between `section`'s markers in `path`; append the section (or create the file) if absent."""
    start_marker, end_marker = markers(section)
    block = f"{start_marker}\n{markdown}{end_marker}"
    text = path.read_text() if path.exists() else ""
    start, end = text.find(start_marker), text.find(end_marker)
    if start != -1 and end > start:
        text = text[:start] + block + text[end + len(end_marker):]
    else:
        text = (text.rstrip("\n") + "\n\n" if text.strip() else "") + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def write_samples(path: Path, samples: Iterable[object]) -> None:
    """One JSON line per request sample (a dataclass), for analysis past the report's figures."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(orjson.dumps(sample) + b"\n" for sample in samples))


@functools.cache
def code_version() -> dict[str, Any]:
    """Which kvgate this process runs: its package's directory and, where git tracks that package, the checkout's
    commit and whether the package's files differ from it (None where git cannot tell: an installed copy). Comparing
    two versions of the code rests on it: `python -m` puts the current directory ahead of PYTHONPATH, so a checkout
    named there loses to the one the command is started in."""
    package = Path(kvgate.__file__).resolve().parent

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(package), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    tracked = git("ls-files", "--error-unmatch", "__init__.py") is not None
    commit = git("rev-parse", "--short=12", "HEAD") if tracked else None
    changes = git("status", "--porcelain", "--untracked-files=no", "--", ".") if commit else None
    return {"path": str(package), "commit": commit, "modified": None if changes is None else bool(changes)}


def describe_code(code: dict[str, Any]) -> str:
    """`code_version()` in words: the package's directory, its commit and whether it was modified."""
    if code["commit"] is None:
        return f"kvgate from {code['path']} (not in a git checkout)"
    return f"kvgate from {code['path']} (commit {code['commit']}{', modified' if code['modified'] else ''})"


def utc_now() -> str:
    """The current UTC time to the minute."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")


class RunMeta:
    """Notes the machine's 1-minute load average when a run starts, to report next to the one at its end."""

    def __init__(self) -> None:
        self._load_before = os.getloadavg()[0]

    def finish(self, **extra: Any) -> dict[str, Any]:
        """The run's metadata now it has ended: date (UTC), CPUs, Python, load average before/after, the code that
        ran, and `extra`."""
        return {"date": utc_now(), "cpus": os.cpu_count(), "python": platform.python_version(),
                "loadavg_1m": [round(self._load_before, 2), round(os.getloadavg()[0], 2)], "code": code_version(),
                **extra}


def table(header: Sequence[str], rows: Iterable[Sequence[object]], right: Sequence[bool] = ()) -> list[str]:
    """A Markdown table's lines; columns marked in `right` are right-aligned."""
    aligns = [right[n] if n < len(right) else False for n in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "|" + "".join("---:|" if r else "---|" for r in aligns)]
    return lines + ["| " + " | ".join(map(str, row)) + " |" for row in rows]


def publish(out: Path, name: str, report: dict[str, Any], markdown: str, docs: Path | None,
            section: str | None = None) -> None:
    """Write out/NAME.json and out/NAME.md, the docs section `section` (default NAME) when `docs` is given; print it."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))
    (out / f"{name}.md").write_text(markdown)
    if docs is not None:
        write_docs_section(docs, section or name, markdown)
    print(markdown)
