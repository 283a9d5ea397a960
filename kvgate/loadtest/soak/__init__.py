"""The soak benchmark: kvgate under long streaming load with faults, its memory and descriptors sampled."""
