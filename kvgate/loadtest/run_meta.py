"""What every benchmark report says about its run: when, on how many CPUs, and how busy the machine was."""

from __future__ import annotations

import datetime
import os
from typing import Any


class RunMeta:
    """Notes the machine's 1-minute load average when a run starts, to report next to the one at its end."""

    def __init__(self) -> None:
        self._load_before = os.getloadavg()[0]

    def finish(self, **extra: Any) -> dict[str, Any]:
        """The run's metadata now it has ended: date (UTC), CPUs, load average before/after, and `extra`."""
        return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                "cpus": os.cpu_count(), "loadavg_1m": [round(self._load_before, 2), round(os.getloadavg()[0], 2)],
                **extra}
