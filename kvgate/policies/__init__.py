"""Pure routing logic: request prefix hashing, the prefix index, scorers and the policies built from them."""

from kvgate.policies.cache_aware import CacheAwarePolicy
from kvgate.policies.config import RoutingConfig
from kvgate.policies.filters import BoundedLoadFilter, load_cap
from kvgate.policies.framework import Cycle, Filter, Picker, Scorer
from kvgate.policies.least_load import LeastLoadPolicy
from kvgate.policies.pickers import MaxScorePicker
from kvgate.policies.prefix_keys import KINDS, block_hashes, build_request_info, prompt_parts
from kvgate.policies.prefix_hash import PrefixHashPolicy
from kvgate.policies.prefix_index import PrefixIndex, index_capacity_blocks
from kvgate.policies.profile import SchedulingProfile, build_profile
from kvgate.policies.registry import DEFAULT_POLICY, POLICY_NAMES, build_policy
from kvgate.policies.round_robin import RoundRobinPolicy
from kvgate.policies.scorers import KvCacheScorer, LoadScorer, PrefixScorer, QueueScorer
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
