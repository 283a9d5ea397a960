"""Rolling restarts of a simulated vLLM fleet under load, as Kubernetes performs them."""

from loadtest.rolling.discovery import ControlledDiscovery, PublishedReplica, ReplicaPhase
from loadtest.rolling.load import SteadyLoad
from loadtest.rolling.replica import RestartableReplica
from loadtest.rolling.restart import RestartRecord, RestartTiming, RollingRestart

__all__ = [
    "ControlledDiscovery",
    "PublishedReplica",
    "ReplicaPhase",
    "RestartRecord",
    "RestartTiming",
    "RestartableReplica",
    "RollingRestart",
    "SteadyLoad",
]
