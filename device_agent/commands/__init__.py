"""Command-line commands of the device side: ``mobizo agent`` (``agent``) and ``mobizo run-program``
(``run_program``), each a module with ``HELP``, ``add_arguments(parser)`` and ``run(args)``."""
