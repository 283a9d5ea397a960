"""The priority benchmark's parts: Poisson workload, open-loop client, rows, summaries and the report."""
