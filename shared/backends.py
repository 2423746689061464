"""The backend names, written once: where a program's frozen matmuls run, where a device runs its steps, and how
a step groups its passes (the schedules).

Standard library only, so the command line lists them as choices without importing pydantic or torch.
"""

from __future__ import annotations

from typing import Literal, get_args

ProgramBackend = Literal["xnnpack", "portable"]  # XNNPACK delegate, or ExecuTorch's portable kernels only
PROGRAM_BACKENDS: tuple[str, ...] = get_args(ProgramBackend)
Quantization = Literal["none", "8da4w"]  # the base linears: float32, or int4 groupwise with int8 activations
QUANTIZATIONS: tuple[str, ...] = get_args(Quantization)
DeviceBackend = Literal["executorch", "torch", "adb"]  # ExecuTorch runtime here, eager PyTorch, a phone over adb
DEVICE_BACKENDS: tuple[str, ...] = get_args(DeviceBackend)
# How a MobiZO step groups its 2q paths into forward passes (shared.zo): the same losses and B, different speed.
Parallel = Literal["both", "outer", "inner", "none"]
PARALLEL_MODES: tuple[str, ...] = get_args(Parallel)

# What a step's loss measures: a classification task's decision (cross-entropy over its single-token candidates,
# MeZO's --train_as_classification), or language modelling (cross-entropy over the whole vocabulary).
Objective = Literal["classification", "lm"]
OBJECTIVES: tuple[str, ...] = get_args(Objective)
# How a step's g moves B (``shared.zo_optim``).
Optimizer = Literal["sgd", "momentum", "normalized"]
OPTIMIZERS: tuple[str, ...] = get_args(Optimizer)
OBJECTIVE_HELP = (
    "what the loss measures: classification (cross-entropy over the task's single-token answers, the default for "
    "classification tasks whose answers are single tokens) or lm (cross-entropy over the whole vocabulary)"
)
