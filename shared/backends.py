"""The backend names, written once: where a program's frozen matmuls run, and where a device runs its steps.

Standard library only, so the command line lists them as choices without importing pydantic or torch.
"""

from __future__ import annotations

from typing import Literal, get_args

ProgramBackend = Literal["xnnpack", "portable"]  # XNNPACK delegate, or ExecuTorch's portable kernels only
PROGRAM_BACKENDS: tuple[str, ...] = get_args(ProgramBackend)
DeviceBackend = Literal["executorch", "torch", "adb"]  # ExecuTorch runtime here, eager PyTorch, a phone over adb
DEVICE_BACKENDS: tuple[str, ...] = get_args(DeviceBackend)
