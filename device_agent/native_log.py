"""Keep the ExecuTorch runtime's informational C++ log lines out of the user's terminal, and nothing else.

On x86 machines the XNNPACK delegate's CPU probe (``cpuinfo_utils.cpp``) logs that it cannot read ARM-only
``/sys`` files each time a program is loaded. The lines are the runtime's, written with ``fprintf(stderr)`` from
C++, so Python's logging cannot filter them: the file descriptor is redirected while the runtime loads, and every
captured line except that probe's is written back to stderr, in order, so real errors still reach the user.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

# The CPU probe's lines: "[cpuinfo_utils.cpp:87] Failed to open midr file ...", "... # of cpus dont match."
_PROBE_LINE = re.compile(r"^\[cpuinfo_utils\.cpp:\d+\] ")


def is_probe_line(line: str) -> bool:
    return bool(_PROBE_LINE.match(line))


@contextmanager
def runtime_log_filtered() -> Iterator[None]:
    """Run the block with file descriptor 2 captured; pass on every line but the CPU probe's afterwards."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            kept = [ln for ln in capture.read().decode(errors="replace").splitlines(True) if not is_probe_line(ln)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()
