"""The benchmark kit: launching, streaming, percentiles, reports."""
