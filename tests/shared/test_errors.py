"""Errors name the field; ``shared.errors``' one table shows it as a CLI flag, REST shows it as it is."""

from __future__ import annotations

import argparse
import pickle

import pytest
from pydantic import ValidationError

from server.commands import jobs
from shared.errors import FieldError, UsageError, cli_flag, usage_error
from shared.manifest import ProgramConfig
from shared.schemas import JobCreate

GOOD_CONFIG = {"q": 2, "batch_size": 4, "seq_len": 16, "answer_len": 2}
GOOD_JOB = {"model": "tiny", "task": "sst2", "q": 2, "batch_size": 4}


def test_cli_flag_is_the_field_with_dashes_unless_the_table_says_otherwise() -> None:
    assert cli_flag("batch_size") == "--batch-size"
    assert cli_flag("lr") == "--lr"
    assert (cli_flag("program_backend"), cli_flag("device_id"), cli_flag("init_adapter_id")) == (
        "--backend",
        "--device",
        "--init-adapter",
    )
    assert cli_flag("batch_size", "export") == "--q"  # the flag one changes to fit q
    assert cli_flag("batch_size", "jobs") == "--batch-size"
    assert cli_flag("seq_len", "export") == "--seq-len"


def test_every_job_option_is_the_flag_the_table_names_for_its_field() -> None:
    """A field's error names the very option that sets it in ``mobizo jobs submit``."""
    parser = argparse.ArgumentParser()
    jobs.add_arguments(parser)
    (subparsers,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    by_dest = {a.dest: a.option_strings for a in subparsers.choices["submit"]._actions}
    for field in (*jobs._FIELDS, "targets", "verbalizer"):
        assert field in JobCreate.model_fields, field
        assert by_dest[field] == [cli_flag(field, "jobs")], field


def test_usage_error_words_and_pickles() -> None:
    exc = UsageError("batch_size", "must be at least 1, got 0")
    assert (exc.field, exc.reason, exc.argument) == ("batch_size", "must be at least 1, got 0", "--batch-size")
    assert str(exc) == "argument --batch-size: must be at least 1, got 0"
    assert exc.message("export") == "argument --q: must be at least 1, got 0"
    field_error = FieldError("device_id", "no such device")
    assert isinstance(field_error, ValueError) and isinstance(field_error, UsageError)
    assert str(field_error) == "device_id: no such device"  # as REST answers
    assert field_error.message() == "argument --device: no such device"  # as the command line shows it
    for error in (exc, field_error):  # a worker process may raise them
        back = pickle.loads(pickle.dumps(error))
        assert (type(back), back.field, back.reason, str(back)) == (type(error), error.field, error.reason, str(error))


@pytest.mark.parametrize(
    ("change", "field"),
    [({"q": 0}, "q"), ({"q": 3}, "batch_size"), ({"answer_len": 16}, "seq_len"), ({"backend": "nope"}, "backend")],
)
def test_usage_error_of_a_program_config_names_the_field(change: dict, field: str) -> None:
    with pytest.raises(ValidationError) as info:
        ProgramConfig(**(GOOD_CONFIG | change))
    exc = usage_error(info.value)
    assert exc.field == field and exc.reason and not exc.reason.startswith(("Value error", field))


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"q": 3}, "batch_size"),
        ({"targets": ["q_proj", "q_proj"]}, "targets"),
        ({"task": None}, "task"),
        ({"task": "sst3"}, "task"),
        ({"task": None, "template": "{text}", "verbalizer": {"0": " a"}}, "verbalizer"),
        ({"program_backend": "nope"}, "program_backend"),
    ],
)
def test_rest_says_the_field_and_the_cli_its_flag(change: dict, field: str) -> None:
    """The 422's message is pydantic's (``server.responses``): a model's check names the field, never a flag."""
    with pytest.raises(ValidationError) as info:
        JobCreate.model_validate(GOOD_JOB | change)
    error = info.value.errors()[0]
    assert field in error["loc"] or error["msg"].startswith(f"Value error, {field}: ")
    assert "--" not in error["msg"]
    exc = usage_error(info.value)
    assert exc.field == field
    assert exc.message("jobs").startswith(f"argument {cli_flag(field)}: ")
