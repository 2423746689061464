"""The device's own data: where a job's file lives, and every training step's batch, built here and never sent.

Step k trains on exactly what ``mobizo train`` uses (``shared.train``): the examples
``batch_indices(n, batch_size, seed, k)`` of the file, as one left-padded, query-major batch
(``shared.data.training_arrays``: NumPy, the device needs no torch), with noise seed ``step_seed(seed, k)``. The one
difference is the width: the batches file has one record size, so rows are padded to the program's ``seq_len`` and
targets to its ``answer_len`` (the program then runs each step at its longest row, ``batches.fit_width``); prompts
are cut from the left to fit ``seq_len`` (``shared.data.encode``), as ``mobizo train --seq-len`` does. Each step
carries its learning rate from the job's schedule (``shared.schedule.lr_at``) times its optimizer's factor
(``shared.zo_optim.step_lr``), as ``mobizo train`` computes it.

Only the examples some step uses are tokenized: rendering checks the whole file (a run never starts on a file it
cannot fully read), but SST-2's 67k lines need not all pass through the tokenizer for a 100-step job.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from device_agent.batches import Shape, StepBatch
from shared import defaults
from shared.errors import DataError
from shared.manifest import ProgramConfig

TRAIN_FILE = "train.jsonl"


def find_train_file(data_dir: Path, task_key: str, task_name: str) -> Path:
    """The training file of a job's task in ``data_dir``.

    Looked for, in order: ``<key>/train.jsonl`` and ``<key>.jsonl`` for the job's task key (the task name, or
    ``custom-<hash>`` for a template, so that data written for one template never trains another), then for the
    task name (``custom/train.jsonl`` serves every custom task).
    """
    data_dir = Path(data_dir)
    candidates = [data_dir / key / TRAIN_FILE for key in dict.fromkeys([task_key, task_name])]
    candidates += [data_dir / f"{key}.jsonl" for key in dict.fromkeys([task_key, task_name])]
    for path in candidates:
        if path.is_file():
            return path
    looked = ", ".join(str(p.relative_to(data_dir)) for p in candidates)
    raise DataError(f"no training data for task {task_key!r} in {data_dir} (looked for {looked})")


def split_held_out(examples: list, wanted: int) -> tuple[list, list]:
    """(training examples, held-out examples): the LAST ``wanted`` examples, at most a fifth of them, are kept out
    of training to measure the adapter on data it never saw (the device's own; nothing of it is uploaded)."""
    held = min(wanted, len(examples) // 5)
    return (examples[: len(examples) - held], examples[len(examples) - held :]) if held else (examples, [])


def program_shape(config: ProgramConfig) -> Shape:
    """The batches shape of a program (its manifest's ``config``): q*E rows, seq_len, answer_len."""
    return Shape(rows=config.batch_size, seq_len=config.seq_len, answer_len=config.answer_len)


def step_batches(
    examples: list,
    tokenizer: Any,
    shape: Shape,
    seed: int,
    steps: int,
    lr: float,
    lr_schedule: str = defaults.LR_SCHEDULE,
    warmup_steps: int = defaults.WARMUP_STEPS,
    lr_floor: float = defaults.LR_FLOOR,
    candidates: tuple[int, ...] = (),
    sample: Callable[[int], list[int]] | None = None,
    optimizer: str = "sgd",
    bucket: int = 1,
) -> Iterator[StepBatch]:
    """Steps ``0 .. steps-1`` of a run over the rendered ``examples`` (``shared.tasks.Rendered``); step k's lr is
    ``shared.schedule.lr_at(lr, steps, k, lr_schedule, warmup_steps, lr_floor)`` (the base ``lr`` and the schedule
    of the job; a bad one raises ``UsageError`` naming its field before anything is tokenized). A classification
    program's ``candidates`` must be every used example's answers (``DataError`` otherwise). ``sample(k)``: step k's
    example indices in place of the run's walk through epochs (a private job's, ``shared.privacy.step_sample``).
    ``optimizer``: the program's (``normalized`` folds its bias correction into each step's lr). ``bucket``: batches
    per length bucket (``shared.data.batch_indices``; every example is encoded first, for its length)."""
    from shared.data import batch_indices, check_candidates, encode, pad_token_id, training_arrays
    from shared.noise import step_seed
    from shared.schedule import lrs
    from shared.zo_optim import step_lr

    rates = [step_lr(optimizer, rate, k) for k, rate in enumerate(lrs(lr, steps, lr_schedule, warmup_steps, lr_floor))]

    lengths = None
    if bucket > 1 and sample is None:
        everything = encode(examples, tokenizer, shape.seq_len)
        lengths = [len(e.prompt_ids) for e in everything]
    pick = sample or (lambda k: batch_indices(len(examples), shape.rows, seed, k, lengths, bucket))
    chosen = [pick(k) for k in range(steps)]
    needed = sorted({i for indices in chosen for i in indices})
    if lengths is not None:
        encoded = {i: everything[i] for i in needed}
    else:
        encoded = dict(zip(needed, encode([examples[i] for i in needed], tokenizer, shape.seq_len), strict=True))
    if candidates:
        check_candidates(list(encoded.values()), candidates)
    pad = pad_token_id(tokenizer)
    for k, indices in enumerate(chosen):
        try:
            arrays = training_arrays([encoded[i] for i in indices], pad, shape.seq_len, shape.answer_len)
        except DataError as exc:
            raise DataError(
                f"step {k}: {exc} (the program fixes seq_len {shape.seq_len}, answer_len {shape.answer_len})"
            ) from None
        yield StepBatch(step_seed(seed, k), rates[k], *arrays)
