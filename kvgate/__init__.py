"""kvgate: a cache-aware inference gateway for vLLM fleets."""
