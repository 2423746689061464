"""Training hyperparameter defaults: the one home of the values a job spec (``shared.schemas.HyperParams``),
``mobizo train`` (``shared.train.TrainConfig``), ``mobizo export`` and a program's config
(``shared.manifest.ProgramConfig``) fall back to when a value is not given.

Torch-free, so the REST schemas read them without loading the algorithm.
"""

from __future__ import annotations

METHOD = "mobizo"
Q = 1
BATCH_SIZE = 16
STEPS = 100
LR = 1e-4
EPS = 1e-2
RANK = 16
ALPHA = 32.0
TARGETS: tuple[str, ...] = ("q_proj", "v_proj")
SEED = 0
A_SEED = 0  # seeds the frozen LoRA A, independent of the run seed
SEQ_LEN = 64  # a job's program length (``mobizo train`` pads each batch to its longest row instead)
PROGRAM_BACKEND = "xnnpack"
