"""Priority classes: their order, and how Inference Extension priorities map onto them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class PriorityConfig:
    """Classes from most to least important, the default, objective names mapped to classes, priority bands."""

    classes: tuple[str, ...] = ("interactive", "batch")
    default: str = "interactive"
    objectives: Mapping[str, str] = field(default_factory=dict)  # objective name -> class
    bands: Mapping[str, int] = field(default_factory=dict)  # class -> lowest InferenceObjective priority it takes

    def rank(self, name: str) -> int:
        """The class's place in the order: 0 for the most important."""
        return self.classes.index(name)


def class_of_priority(priority: int, config: PriorityConfig) -> str:
    """The class of an Inference Extension priority (higher is more important, negative is sheddable).

    With `bands`, the first class (most important first) whose lowest priority it reaches, else the last class;
    without, 0 and above are the first class and negative priorities the last.
    """
    bands = config.bands or {config.classes[0]: 0}
    return next((name for name in config.classes if name in bands and priority >= bands[name]), config.classes[-1])
