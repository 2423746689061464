"""Benchmarks: one question per script (see each module docstring); run as ``python benchmarks/NAME.py``."""
