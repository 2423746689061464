"""Command-line subcommands of the core (each module: ``add_arguments(parser)`` and ``run(args) -> int``).

Modules here import only ``argparse`` at import time; heavy imports happen inside ``run`` so that
``mobizo --help`` stays fast.
"""
