"""The real-engine kit: the interpreter it is given, and its failure report (an engine that dies says why, not only how
its API server ended)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvgate.loadtest.kit.vllm_engine import VLLM_PYTHON_ENV, EngineSpec, VllmEngine, vllm_python


def test_a_relative_interpreter_is_made_absolute_with_its_symlink_kept(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # Engines run in their own directories, so `KVGATE_VLLM_PYTHON=.venv-vllm/bin/python` must not stay relative;
    # a virtual environment's interpreter is a symlink to the base one, which lacks vLLM, so it must not be resolved.
    tmp_path.joinpath("base-python").write_text("")
    tmp_path.joinpath("venv", "bin").mkdir(parents=True)
    tmp_path.joinpath("venv", "bin", "python").symlink_to(tmp_path / "base-python")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(VLLM_PYTHON_ENV, "venv/bin/python")
    assert vllm_python() == str(tmp_path / "venv" / "bin" / "python")
    monkeypatch.setenv(VLLM_PYTHON_ENV, "venv/bin/no-such-python")
    assert vllm_python() is None


def test_a_dead_engines_report_holds_its_first_error_and_its_last_lines(tmp_path: Path) -> None:
    engine = VllmEngine(EngineSpec(port=1, cpu=0, model_dir=tmp_path), tmp_path, "python")
    assert engine.log_tail() == ""  # never started: no log
    lines = [f"INFO starting {number}" for number in range(100)]
    lines += ["ERROR EngineCore failed to start.", "Traceback (most recent call last):", "ValueError: no KV room"]
    lines += [f"  api server frame {number}" for number in range(100)]
    tmp_path.joinpath("engine.log").write_text("\n".join(lines))
    report = engine.log_tail(lines=10).splitlines()
    assert report[:3] == ["ERROR EngineCore failed to start.", "Traceback (most recent call last):",
                          "ValueError: no KV room"]
    assert report[10] == "..." and report[-1] == "  api server frame 99" and len(report) == 21
    assert "INFO starting 99" not in report
    tmp_path.joinpath("engine.log").write_text("\n".join(lines[:30]))  # no error: the last lines only
    assert engine.log_tail(lines=10).splitlines() == lines[20:30]
