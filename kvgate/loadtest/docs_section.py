"""Splicing one benchmark's Markdown section into a shared docs file between its markers."""

from __future__ import annotations

from pathlib import Path


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
