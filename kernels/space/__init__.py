"""The search space: template families, config lists and `supports()`, scaling to a problem, the lookup table and
the performance model that ranks candidates. Imports only kernels.core."""
