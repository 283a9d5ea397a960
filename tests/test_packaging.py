"""The distribution installs one top-level package, and the product's CLI leaves the benchmark kit alone."""

from __future__ import annotations

import subprocess
import sys


def _run_outside_repo(code: str, tmp_path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)


def test_only_the_kvgate_namespace_is_importable_after_install(tmp_path):
    for name in ("router", "endpoints", "policies", "loadtest"):
        done = _run_outside_repo(f"import {name}", tmp_path)
        assert done.returncode != 0 and "ModuleNotFoundError" in done.stderr, name
    assert _run_outside_repo("import kvgate.router.cli, kvgate.simulator", tmp_path).returncode == 0


def test_serving_cli_does_not_import_the_benchmark_kit(tmp_path):
    code = ("import sys; from kvgate.router import cli, gateway, server; "
            "from kvgate.router.cli import build_parser; build_parser(); "
            "print(sorted(m for m in sys.modules if m.startswith('kvgate.loadtest')))")
    done = _run_outside_repo(code, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
