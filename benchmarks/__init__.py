"""Benchmarks: one question per script (see each module docstring). Run them from the repository root as
``python -m benchmarks.NAME``, so that ``benchmarks.*`` and the project's packages import."""
