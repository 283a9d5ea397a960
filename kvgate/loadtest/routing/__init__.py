"""The routing benchmarks: policies and other routers on a simulated or real fleet, one workload at a time."""
