"""The backend names, written once: where a program's frozen matmuls run, where a device runs its steps, and how
a step groups its passes (the schedules).

Standard library only, so the command line lists them as choices without importing pydantic or torch.
"""

from __future__ import annotations

from typing import Literal, get_args

ProgramBackend = Literal["xnnpack", "portable"]  # XNNPACK delegate, or ExecuTorch's portable kernels only
PROGRAM_BACKENDS: tuple[str, ...] = get_args(ProgramBackend)
MergeDtype = Literal["float32", "bfloat16", "float16"]  # what ``mobizo adapters merge`` stores
MERGE_DTYPES: tuple[str, ...] = get_args(MergeDtype)
Quantization = Literal["none", "8da4w"]  # the base linears: float32, or int4 groupwise with int8 activations
QUANTIZATIONS: tuple[str, ...] = get_args(Quantization)
# ExecuTorch runtime here, eager PyTorch, the native runner on a phone over adb, the native runner here
DeviceBackend = Literal["executorch", "torch", "adb", "native"]
DEVICE_BACKENDS: tuple[str, ...] = get_args(DeviceBackend)
RUNNER_BACKENDS: tuple[str, ...] = ("adb", "native")  # the ones that drive the native runner (device_agent/runner)
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
# How a step weighs its probes' g (``shared.zo``): equally, or by each probe's curvature (1.5-SPSA; a clean path each)
ProbeWeights = Literal["none", "curvature"]
PROBE_WEIGHTS: tuple[str, ...] = get_args(ProbeWeights)
PROBE_WEIGHTS_HELP = (
    "how a mobizo step weighs its probes' g: none (default), or curvature (1.5-SPSA: a clean path beside each "
    "query's pair, 1.5x the paths of a step, and each g times 1 / max(h ** (1/8), 1) for its probe's curvature h; "
    "docs/method.md#probe-weights)"
)
OBJECTIVE_HELP = (
    "what the loss measures: classification (cross-entropy over the task's single-token answers, the default for "
    "classification tasks whose answers are single tokens) or lm (cross-entropy over the whole vocabulary)"
)
