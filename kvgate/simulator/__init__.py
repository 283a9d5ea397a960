"""A vLLM OpenAI-server simulator: prefix caching, scheduling and timing without a GPU."""

from kvgate.simulator.fleet import SimFleet, serve_fleet
from kvgate.simulator.options import SimOptions, add_sim_arguments, sim_options_from_args
from kvgate.simulator.server import SimReplica

__all__ = ["SimFleet", "SimOptions", "SimReplica", "add_sim_arguments", "serve_fleet", "sim_options_from_args"]
