"""Benchmarks and simulations; run as modules from the repository root."""
