"""Rolling restarts of a simulated vLLM fleet under load, as Kubernetes performs them."""
