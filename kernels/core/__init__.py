"""Records and leaf utilities every layer shares: the problem, choices, selections, errors, settings, files.
Imports nothing else from kernels/ or backends/."""
