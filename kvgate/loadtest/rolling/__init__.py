"""Rolling restarts of a simulated vLLM fleet under load, as Kubernetes performs them."""

from kvgate.loadtest.rolling.discovery import ControlledDiscovery, PublishedReplica, ReplicaPhase
from kvgate.loadtest.rolling.load import SteadyLoad
from kvgate.loadtest.rolling.replica import RestartableReplica
from kvgate.loadtest.rolling.restart import RestartRecord, RestartTiming, RollingRestart

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
