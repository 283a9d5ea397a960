"""The real-engine kit's failure report: an engine that dies says why, not only how its API server ended."""

from __future__ import annotations

from pathlib import Path

from kvgate.loadtest.kit.vllm_engine import EngineSpec, VllmEngine


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
