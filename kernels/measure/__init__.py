"""Measuring a launch: inputs as the user passes them, the float64 reference check, and the one timing routine.
Imports only kernels.core; backends' isolated child and tuning both use it."""
