"""The files of a verify task carried through the bucket (``MOBIZO_STORE_URL``), for verify workers on machines
that do not share the API process's data dir.

Every function the verify queue runs (``server.celery_queue.VERIFY_FUNCTIONS``) takes its inputs as file paths
and one folder for its outputs, and answers paths in that folder (alone, or as values of a dict). So the API
process uploads each file argument under ``tmp/verify-<id>/``, the worker fetches them into a folder of its own
data dir, runs the function, uploads the output files it answers and names them in its reply, and the API process
fetches those into its own output folder and then deletes the task's objects. Without a bucket none of this runs:
paths travel as they are, in a data dir the workers share as a volume.

A task can run twice: the broker redelivers one still running past its visibility timeout. When the second run
ends after the API process took the first one's answer and deleted the spool, its outputs would stay in the
bucket for good; so a worker that finds the task's inputs gone after uploading its outputs deletes them again
(``send_result``).
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

from server.object_store import SharedObjects

_FILE, _FOLDER = "spooled_file", "output_folder"


def new_spool() -> str:
    return f"tmp/verify-{uuid.uuid4().hex}"


def send_args(shared: SharedObjects, spool: str, args: tuple[Any, ...]) -> tuple[list[Any], Path | None]:
    """API side: upload the file arguments → (the task's arguments, the output folder argument)."""
    sent, folder = [], None
    for index, arg in enumerate(args):
        if isinstance(arg, str) and os.path.isfile(arg):
            name = f"{spool}/in-{index}-{Path(arg).name}"
            shared.put(name, Path(arg))
            sent.append({_FILE: name})
        elif isinstance(arg, str) and os.path.isdir(arg):
            folder = Path(arg)
            sent.append({_FOLDER: True})
        else:
            sent.append(arg)
    return sent, folder


def receive_args(shared: SharedObjects, args: list[Any], local: Path) -> tuple[list[Any], Path]:
    """Worker side: fetch the file arguments into ``local`` → (the function's arguments, its output folder)."""
    out = local / "out"
    out.mkdir()
    received = []
    for arg in args:
        if isinstance(arg, dict) and _FILE in arg:
            path = local / Path(arg[_FILE]).name
            if not shared.get(arg[_FILE], path):
                raise FileNotFoundError(f"{arg[_FILE]} is not in the bucket")
            received.append(str(path))
        elif isinstance(arg, dict) and _FOLDER in arg:
            received.append(str(out))
        else:
            received.append(arg)
    return received, out


def send_result(shared: SharedObjects, spool: str, args: list[Any], value: Any, out: Path) -> Any:
    """Worker side: upload the output files the function answered → the answer naming them. When the task's
    inputs (``args``, as the API process sent them) are gone by then, the API process has already taken another
    delivery's answer and deleted the spool: the outputs just uploaded are deleted too."""

    def one(item: Any) -> Any:
        if isinstance(item, str) and Path(item).parent == out and Path(item).is_file():
            name = f"{spool}/out-{Path(item).name}"
            shared.put(name, Path(item))
            return {_FILE: name}
        return item

    answer = {key: one(item) for key, item in value.items()} if isinstance(value, dict) else one(value)
    inputs = [arg[_FILE] for arg in args if isinstance(arg, dict) and _FILE in arg]
    if inputs and not all(shared.exists(name) for name in inputs):
        shared.delete_prefix(spool)
    return answer


def receive_result(shared: SharedObjects, value: Any, folder: Path) -> Any:
    """API side: fetch the output files into the output folder → the answer with local paths, as a local
    worker would have given it."""

    def one(item: Any) -> Any:
        if isinstance(item, dict) and _FILE in item:
            path = folder / Path(item[_FILE]).name.removeprefix("out-")
            if not shared.get(item[_FILE], path):
                raise FileNotFoundError(f"{item[_FILE]} is not in the bucket")
            return str(path)
        return item

    if isinstance(value, dict) and _FILE not in value:
        return {key: one(item) for key, item in value.items()}
    return one(value)
