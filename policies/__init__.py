"""Pure routing logic: request prefix hashing, the prefix index, scorers and the policies built from them."""

from policies.cache_aware import CacheAwarePolicy
from policies.config import RoutingConfig
from policies.filters import BoundedLoadFilter, load_cap
from policies.framework import Cycle, Filter, Picker, Scorer
from policies.least_load import LeastLoadPolicy
from policies.pickers import MaxScorePicker
from policies.prefix import KINDS, block_hashes, build_request_info, prompt_parts
from policies.prefix_hash import PrefixHashPolicy
from policies.prefix_index import PrefixIndex, index_capacity_blocks
from policies.profile import SchedulingProfile, build_profile
from policies.registry import DEFAULT_POLICY, POLICY_NAMES, build_policy
from policies.round_robin import RoundRobinPolicy
from policies.scorers import KvCacheScorer, LoadScorer, PrefixScorer, QueueScorer
from policies.types import REASONS, Decision, Policy, RequestInfo

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
    "KvCacheScorer",
    "LeastLoadPolicy",
    "LoadScorer",
    "MaxScorePicker",
    "Picker",
    "Policy",
    "PrefixHashPolicy",
    "PrefixIndex",
    "PrefixScorer",
    "QueueScorer",
    "RequestInfo",
    "RoundRobinPolicy",
    "RoutingConfig",
    "SchedulingProfile",
    "Scorer",
    "block_hashes",
    "build_policy",
    "build_profile",
    "build_request_info",
    "index_capacity_blocks",
    "load_cap",
    "prompt_parts",
]
