"""The runtime's CPU-probe lines are kept from the user's terminal; anything else it writes to stderr gets through."""

from __future__ import annotations

import subprocess
import sys
import textwrap

PROBE = "[cpuinfo_utils.cpp:87] Failed to open midr file /sys/devices/soc0/image_version"


def test_probe_lines_are_dropped_and_other_native_lines_kept_in_order() -> None:
    # Written to file descriptor 2 directly, as the C++ runtime does, from a child process with its own stderr.
    script = textwrap.dedent(
        f"""
        import os, sys
        from device_agent.native_log import runtime_log_filtered
        with runtime_log_filtered():
            os.write(2, b"{PROBE}\\n[program.cpp:168] Program identifier mismatch\\n")
            print("python says hi", file=sys.stderr)
        print("after", file=sys.stderr)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert done.stderr.splitlines() == ["[program.cpp:168] Program identifier mismatch", "python says hi", "after"]


def test_an_error_inside_still_restores_stderr_and_reports() -> None:
    script = textwrap.dedent(
        """
        import os
        from device_agent.native_log import runtime_log_filtered
        try:
            with runtime_log_filtered():
                os.write(2, b"native error\\n")
                raise RuntimeError("load failed")
        except RuntimeError:
            os.write(2, b"restored\\n")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert done.stderr.splitlines() == ["native error", "restored"]
