"""Scheduling: the loop on the MLX thread, its requests (sequences), the one decoding round,
sampling and stop strings, and switching between targets."""
