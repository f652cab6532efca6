"""Offline tools (not imported by the runtime): performance-model data collection, training and evaluation."""
