"""Pure routing logic: request prefix hashing, the prefix index, scorers and the policies built from them."""

from kvgate.policies.cache_aware import CacheAwarePolicy
from kvgate.policies.config import RoutingConfig
from kvgate.policies.filters import BoundedLoadFilter, load_cap
from kvgate.policies.cost import RequestCost, prompt_tokens, tokens_per_block
from kvgate.policies.filters import FreeSeatFilter
from kvgate.policies.framework import Cycle, Filter, Picker
from kvgate.policies.least_load import LeastLoadPolicy
from kvgate.policies.pickers import LowestCostPicker
from kvgate.policies.prefix_keys import KINDS, block_hashes, build_request_info, prompt_parts
from kvgate.policies.prefix_hash import PrefixHashPolicy
from kvgate.policies.prefix_index import PrefixIndex, index_capacity_blocks
from kvgate.policies.profile import SchedulingProfile, continuation_profile, placement_profile
from kvgate.policies.registry import DEFAULT_POLICY, POLICY_NAMES, build_policy
from kvgate.policies.round_robin import RoundRobinPolicy
from kvgate.policies.types import REASONS, Decision, Policy, RequestInfo

__all__ = [
    "DEFAULT_POLICY",
    "KINDS",
    "POLICY_NAMES",
    "REASONS",
    "BoundedLoadFilter",
    "CacheAwarePolicy",
    "Cycle",
    "Decision",
    "Filter",
    "FreeSeatFilter",
    "LeastLoadPolicy",
    "LowestCostPicker",
    "Picker",
    "Policy",
    "PrefixHashPolicy",
    "PrefixIndex",
    "RequestCost",
    "RequestInfo",
    "RoundRobinPolicy",
    "RoutingConfig",
    "SchedulingProfile",
    "block_hashes",
    "build_policy",
    "build_request_info",
    "continuation_profile",
    "index_capacity_blocks",
    "load_cap",
    "placement_profile",
    "prompt_parts",
    "prompt_tokens",
    "tokens_per_block",
]
