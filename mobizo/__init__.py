"""The ``mobizo`` command: one entry point that dispatches to the core, server and agent commands."""
