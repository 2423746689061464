"""``mobizo jobs submit|list|show|cancel``: fine-tuning jobs of your user on the server.

``submit`` checks the spec locally with the same schema the server uses (``shared.schemas.JobCreate``), so a bad
option exits 2 naming it before anything is sent; options left out take the server's defaults.
"""

from __future__ import annotations

import argparse

from server.commands import add_connection_args, client_from_args, print_json, print_table
from shared.backends import DEVICE_BACKENDS, PROGRAM_BACKENDS
from shared.errors import ExitCode

HELP = "submit, list, show and cancel fine-tuning jobs"

# option → JobCreate field, for options whose value is used as given
_FIELDS = (
    "model",
    "task",
    "template",
    "q",
    "batch_size",
    "steps",
    "lr",
    "eps",
    "rank",
    "alpha",
    "seq_len",
    "answer_len",
    "seed",
    "a_seed",
    "program_backend",
    "device_id",
    "device_backend",
    "init_adapter_id",
)
# JobCreate fields whose option has another name
_OPTIONS = {"program_backend": "backend", "device_id": "device", "init_adapter_id": "init-adapter"}


def _add_submit(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("submit", help="submit a job (prints it as JSON)")
    p.add_argument("--model", required=True, help="a registered model's name")
    p.add_argument("--task", help="built-in task (sst2, rte, ..., lm) or custom")
    p.add_argument("--template", help='custom task template, e.g. "{text} It was"')
    p.add_argument("--verbalizer", help='custom task verbalizer as JSON, e.g. \'{"0": " bad", "1": " good"}\'')
    for name, kind, text in (
        ("q", int, "queries per step (outer-loop paths); must divide --batch-size"),
        ("batch-size", int, "examples per step; each query sees batch-size / q of them"),
        ("steps", int, "training steps"),
        ("lr", float, "learning rate"),
        ("eps", float, "perturbation scale"),
        ("rank", int, "LoRA rank"),
        ("alpha", float, "LoRA alpha (scaling alpha / rank)"),
        ("seq-len", int, "the program's fixed width in tokens (rows left-padded, prompts cut from the left)"),
        ("answer-len", int, "answer tokens per row (default: the task's longest answer)"),
        ("seed", int, "run seed: batch order and step seeds"),
        ("a-seed", int, "seed of the frozen LoRA A"),
    ):
        p.add_argument(f"--{name}", type=kind, help=text + " (default: the server's)")
    p.add_argument("--targets", help="comma-separated module names (default q_proj,v_proj)")
    p.add_argument("--backend", dest="program_backend", choices=PROGRAM_BACKENDS)
    p.add_argument("--device", dest="device_id", type=int, help="run on this device only")
    p.add_argument("--device-backend", choices=DEVICE_BACKENDS)
    p.add_argument("--init-adapter", dest="init_adapter_id", type=int, help="start from this adapter's B")
    add_connection_args(p)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    _add_submit(sub)
    listing = sub.add_parser("list", help="your jobs, newest first")
    listing.add_argument("--json", action="store_true", help="print the full objects as JSON")
    add_connection_args(listing)
    for action, text in (("show", "one job as JSON (status, progress, error)"), ("cancel", "cancel a job")):
        p = sub.add_parser(action, help=text)
        p.add_argument("job_id", type=int)
        add_connection_args(p)


def job_body(args: argparse.Namespace) -> dict:
    """The JobCreate body from the options; ``UsageError`` naming the option for anything the schema rejects."""
    import json

    from pydantic import ValidationError

    from shared.errors import UsageError
    from shared.schemas import JobCreate

    body = {f: getattr(args, f) for f in _FIELDS if getattr(args, f, None) is not None}
    if args.targets is not None:
        body["targets"] = [t.strip() for t in args.targets.split(",") if t.strip()]
    if args.verbalizer is not None:
        try:
            body["verbalizer"] = json.loads(args.verbalizer)
        except json.JSONDecodeError as exc:
            raise UsageError("--verbalizer", f"not JSON ({exc.msg})") from None
    try:
        return JobCreate.model_validate(body).model_dump(mode="json", exclude_unset=True)
    except ValidationError as exc:
        error = exc.errors()[0]
        message = error["msg"].removeprefix("Value error, ")
        field = str(error["loc"][0]) if error["loc"] else message.split(":")[0]
        option = _OPTIONS.get(field, field)
        raise UsageError(f"--{option.replace('_', '-')}", message.removeprefix(f"{field}: ")) from None


def run(args: argparse.Namespace) -> ExitCode:
    if args.action == "submit":
        body = job_body(args)
        print_json(client_from_args(args).post("/v1/jobs", body))
    elif args.action == "list":
        jobs = client_from_args(args).get("/v1/jobs")
        if args.json:
            print_json(jobs)
        else:
            rows = [{**j, "step": j["progress"]["step"], "loss": j["progress"]["loss"]} for j in jobs["data"]]
            print_table(rows, ["id", "status", "model", "task", "step", "loss", "adapter_id", "error"])
    else:
        client = client_from_args(args)
        path = f"/v1/jobs/{args.job_id}" + ("/cancel" if args.action == "cancel" else "")
        print_json(client.post(path) if args.action == "cancel" else client.get(path))
    return ExitCode.OK
