"""The program contract is resolved once (``shared.program_config.resolve_program``): a job the server compiles and
``mobizo export`` with the same options name the same program, for each objective and with a calibrated prior."""

from __future__ import annotations

from pathlib import Path

import pytest

from mobizo.cli import build_parser
from server.compile import resolve_config
from shared.commands.export import config_from_args
from shared.errors import UsageError
from shared.manifest import ProgramConfig
from shared.program_config import resolve_program
from shared.schemas import JobCreate
from shared.tasks import get_task
from tests.utils.programs import TINY_Q4, TINY_Q4_JOB


def _export_args(model: Path, *options: str):
    return build_parser().parse_args(["export", "--model", str(model), "--out", "x.pte", *options])


@pytest.mark.parametrize("objective", ["classification", "lm"])
def test_a_job_and_mobizo_export_with_its_options_are_one_program(tiny_model_dir: Path, objective: str) -> None:
    from transformers import AutoTokenizer

    job = JobCreate(**{**TINY_Q4_JOB, "steps": 1, "objective": objective}).model_dump(mode="json")
    served = ProgramConfig.model_validate(resolve_config(tiny_model_dir, job))
    options = ["--task", "sst2", "--q", "4", "--batch-size", "8", "--seq-len", "16", "--rank", "4", "--alpha", "8"]
    options += ["--objective", objective]
    exported = config_from_args(_export_args(tiny_model_dir, *options), AutoTokenizer.from_pretrained(tiny_model_dir))
    assert exported == served
    assert (served == TINY_Q4) is (objective == "classification")  # the suite's shared program is the job's


def test_a_calibrated_program_takes_the_prior_it_is_given_and_refuses_to_guess(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer, task = AutoTokenizer.from_pretrained(tiny_model_dir), get_task("sst2")
    spec = JobCreate(**{**TINY_Q4_JOB, "steps": 1, "objective": "classification", "calibrate": True})
    spec = spec.model_dump(mode="json")
    config = resolve_program(spec, task, tokenizer, None, lambda: (-0.5, -1.5))
    assert config.prior == (-0.5, -1.5) and config.candidates == TINY_Q4.candidates
    with pytest.raises(UsageError) as refused:
        resolve_program(spec, task, tokenizer)
    assert refused.value.field == "calibrate"
    assert resolve_program(spec | {"calibrate": False}, task, tokenizer).prior == ()
