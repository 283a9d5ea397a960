"""A vLLM OpenAI-server simulator: prefix caching, scheduling and timing without a GPU."""

from loadtest.simulator.fleet import SimFleet, serve_fleet
from loadtest.simulator.options import SimOptions, add_sim_arguments, sim_options_from_args
from loadtest.simulator.server import SimReplica

__all__ = ["SimFleet", "SimOptions", "SimReplica", "add_sim_arguments", "serve_fleet", "sim_options_from_args"]
