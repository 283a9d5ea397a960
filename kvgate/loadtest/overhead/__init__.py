"""Benchmark of kvgate's own overhead: trivial upstream stubs, kvgate as a subprocess, a separate load generator."""
