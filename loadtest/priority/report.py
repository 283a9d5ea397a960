"""The markdown report and its section in docs/benchmarks.md."""
from pathlib import Path
import json
def render_markdown(report): return json.dumps(report, indent=1, default=str)
def write_docs_section(path: Path, markdown: str): pass
