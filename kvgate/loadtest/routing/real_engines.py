"""`kvgate bench real-engines`: the routing rows on real vLLM engines (the CPU build, one per core; the interpreter
from $KVGATE_VLLM_PYTHON, which `./dev real` sets up), hit rates from vLLM's own counters."""

from __future__ import annotations

import argparse

from kvgate.loadtest.kit.vllm_engine import require_vllm_python
from kvgate.loadtest.routing.scenario import add_arguments, chat_loads, run_loads

__all__ = ["add_arguments", "run"]


def run(options: argparse.Namespace) -> int:
    """Measure every row on real engines; BadOption when no interpreter with vLLM is set up."""
    python = require_vllm_python()
    tokenizer_dir = options.out / "vllm" / "model" if options.precise else None  # where the engines' model is written
    return run_loads(options, chat_loads(options), "Routing benchmark on real vLLM engines", "routing-real-engines",
                     python, tokenizer_dir)
