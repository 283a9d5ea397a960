"""Reading a request's priority class and fairness flow from its headers."""

from __future__ import annotations

from collections.abc import Mapping

from kvgate.policies.priorities import PriorityConfig, class_of_priority
from kvgate.policies.types import DEFAULT_FLOW

PRIORITY_HEADER = "x-priority"
OBJECTIVE_HEADER = "x-gateway-inference-objective"
FAIRNESS_HEADER = "x-gateway-inference-fairness-id"
_MAX_FLOW_CHARS = 128


class PriorityError(ValueError):
    """A priority header names no known class; the message names the header."""

    def __init__(self, header: str, message: str) -> None:
        super().__init__(message)
        self.header = header


def classify(headers: Mapping[str, str], config: PriorityConfig, fallback: str | None = None,
             objectives: Mapping[str, int] | None = None) -> str:
    """The request's class: x-priority, else x-gateway-inference-objective, else `fallback` or the default.

    An objective is looked up in `config.objectives` (name -> class), then in `objectives` (the pool's
    InferenceObjectives, name -> priority), else read as an integer priority; priorities map to classes by
    class_of_priority.
    """
    value = headers.get(PRIORITY_HEADER)
    if value is not None:
        name = value.strip().lower()
        if name not in config.classes:
            raise PriorityError(PRIORITY_HEADER, f"header {PRIORITY_HEADER} must be one of "
                                                 f"{', '.join(config.classes)}, got {value[:64]!r}")
        return name
    objective = headers.get(OBJECTIVE_HEADER)
    if objective is not None:
        name = objective.strip()
        if name in config.objectives:
            return config.objectives[name]
        if objectives and name in objectives:
            return class_of_priority(objectives[name], config)
        try:
            return class_of_priority(int(name), config)
        except ValueError:
            raise PriorityError(OBJECTIVE_HEADER, f"header {OBJECTIVE_HEADER} names an unknown objective "
                                                  f"{objective[:64]!r}") from None
    return fallback or config.default


def fairness_id(headers: Mapping[str, str]) -> str:
    """The request's flow within its class: x-gateway-inference-fairness-id (cut to 128 characters), else the default."""
    return headers.get(FAIRNESS_HEADER, "").strip()[:_MAX_FLOW_CHARS] or DEFAULT_FLOW
