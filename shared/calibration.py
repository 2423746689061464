"""Contextual calibration of a classification prompt's candidate scores (Zhao et al., ICML 2021, "Calibrate Before
Use"): the prior a prompt puts on each answer, measured on content-free inputs, divided out of every example's.

A prompt leans towards some answers whatever the input: SmolLM2-135M-Instruct reading SST-2 through its chosen
prompt answers " negative" 60 % of the time on balanced data. The prior is measured by rendering the task's
template with every field set to a content-free text (``CONTENT_FREE``: "N/A", "", "[MASK]", the paper's three),
taking each answer's probability among the task's answers (the softmax of their scores, ``shared.evaluate``'s mean
log-likelihoods) and averaging over the three inputs: p_cf. A calibrated score is the score minus log p_cf, so the
prediction is argmax_c p(c | x) / p_cf(c), the paper's diagonal W with b = 0. The loss of a calibrated example is
the cross-entropy of its calibrated scores (``shared.zo.example_losses`` takes the same prior as a float32 constant).

The prior is measured once, on the base model (no adapter), and kept as float32 values: a run, its program and
the replay of its log subtract the very same numbers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from shared.tasks import Rendered, Task

CONTENT_FREE: tuple[str, ...] = ("N/A", "", "[MASK]")


def content_free(task: Task) -> list[Rendered]:
    """The task's prompt rendered with every text field set to each ``CONTENT_FREE`` text (label: the first)."""
    from shared.tasks import placeholder_record

    rendered = []
    for text in CONTENT_FREE:
        record = placeholder_record(task)
        stack = [record]
        while stack:  # every text field, dotted paths included, becomes ``text``
            node = stack.pop()
            for key, value in node.items():
                if isinstance(value, dict):
                    stack.append(value)
                elif key != "label":
                    node[key] = text
        rendered.append(task.render(record))
    return rendered


def prior_of(scores: Sequence[Sequence[float]]) -> tuple[float, ...]:
    """log p_cf per candidate from the content-free inputs' candidate scores (float64 math, float32 values)."""
    rows = np.asarray(scores, dtype=np.float64)
    probs = np.exp(rows - rows.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    return tuple(float(np.float32(math.log(p))) for p in probs.mean(axis=0))


def calibrated(row: Sequence[float], prior: Sequence[float] | None) -> list[float]:
    """An example's candidate scores with the prior divided out (as they are when ``prior`` is None)."""
    return list(row) if prior is None else [s - p for s, p in zip(row, prior, strict=True)]
