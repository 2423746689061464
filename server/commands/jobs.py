"""``mobizo jobs submit|list|show|cancel``: fine-tuning jobs of your user on the server, and (with the admin
token) the cohorts' federated jobs.

``submit`` checks the spec locally with the same schema the server uses (``shared.schemas.JobCreate``, or
``FederatedJobCreate`` with ``--cohort``), so a bad option exits 2 naming it before anything is sent; options left
out take the server's defaults. With ``--cohort`` the token defaults to ``$MOBIZO_ADMIN_TOKEN``.
"""

from __future__ import annotations

import argparse

from server.commands import add_connection_args, client_from_args, print_json, print_table
from shared import defaults
from shared.backends import (
    DEVICE_BACKENDS,
    OBJECTIVE_HELP,
    OBJECTIVES,
    OPTIMIZERS,
    PARALLEL_MODES,
    PROBE_WEIGHTS,
    PROBE_WEIGHTS_HELP,
    PROGRAM_BACKENDS,
    QUANTIZATIONS,
)
from shared.errors import ExitCode, cli_flag
from shared.schedule import SCHEDULES
from shared.tasks import BUCKET_HELP, BUILTIN_HELP, CALIBRATE_HELP, TEMPLATE_HELP, VERBALIZER_HELP

HELP = "submit, list, show and cancel fine-tuning jobs"

# options → fields of both personal and federated jobs (HyperParams), used as given
_HYPER = (
    "q",
    "batch_size",
    "bucket",
    "lr",
    "lr_schedule",
    "warmup_steps",
    "lr_floor",
    "eps",
    "rank",
    "alpha",
    "seq_len",
    "answer_len",
    "seed",
    "a_seed",
    "program_backend",
    "quantize",
    "group_size",
    "parallel",
    "objective",
    "optimizer",
    "probe_weights",
)
# option → JobCreate field, for options whose value is used as given
_FIELDS = (
    "model",
    "task",
    "template",
    "chat_template",
    "calibrate",
    "prompt",
    "steps",
    "eval_every",
    *_HYPER,
    "device_id",
    "device_backend",
    "init_adapter_id",
    "upload",
    "standing",
    "sessions",
)
# FederatedJobCreate fields of a federated job's options (besides the hyperparameters)
_FEDERATION = (
    "rounds",
    "clients_per_round",
    "min_clients",
    "round_timeout_s",
    "aggregation",
    "trim_fraction",
    "global_lr",
    "server_momentum",
    "max_abs_g",
    "mode",
    "max_staleness",
    "concurrency",
)
_PRIVACY = ("epsilon", "delta", "clip", "min_examples")  # --dp-<name> → JobCreate.privacy.<name>
_PERSONAL_ONLY = (
    "model",
    "task",
    "template",
    "verbalizer",
    "prompt",
    "steps",
    "device_id",
    "device_backend",
    "init_adapter_id",
    "standing",
    "sessions",
)


def _add_submit(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "submit",
        help="submit a job, or with --cohort a federated job (prints it as JSON)",
        epilog=f"Defaults of --steps, --lr, --lr-schedule, --eps and --rank by method and objective: "
        f"{defaults.describe()}.",
    )
    p.add_argument("--model", help="a registered model's name (required, except with --cohort)")
    p.add_argument("--task", help="built-in task (sst2, rte, ..., lm) or custom")
    p.add_argument("--template", help=TEMPLATE_HELP)
    p.add_argument("--verbalizer", help=VERBALIZER_HELP)
    p.add_argument("--prompt", choices=("model", "builtin"), help=BUILTIN_HELP)
    p.add_argument("--calibrate", action="store_true", default=None, help=CALIBRATE_HELP)
    p.add_argument(
        "--chat-template",
        action="store_true",
        default=None,
        help="frame each prompt with the model's chat template (instruct models); stored in the job spec",
    )
    for field, kind, text in (
        (
            "q",
            int,
            f"queries per step (outer-loop paths; default {defaults.Q} for mobizo, 1 otherwise); must divide "
            "--batch-size",
        ),
        ("batch_size", int, "examples per step; each query sees batch-size / q of them"),
        ("bucket", int, BUCKET_HELP),
        ("steps", int, "training steps (default: the method's, below)"),
        ("eval_every", int, "also measure the device's held-out slice every K steps (default: before and after)"),
        ("lr", float, "base learning rate, the schedule's peak (default: the method's, below)"),
        ("warmup_steps", int, "raise lr linearly over the first W steps, lr*(k+1)/W at step k; W < steps"),
        ("lr_floor", float, "where linear and cosine decay end, as a fraction of lr in [0, 1]"),
        ("eps", float, "perturbation scale (default: the method's, below)"),
        ("rank", int, "LoRA rank (default: the objective's, below)"),
        ("alpha", float, f"LoRA alpha, the scaling alpha / rank (default: {defaults.SCALING:g} x rank)"),
        ("seq_len", int, "the program's fixed width in tokens (rows left-padded, prompts cut from the left)"),
        ("answer_len", int, "answer tokens per row (default: the task's longest answer)"),
        ("seed", int, "run seed: batch order and step seeds"),
        ("a_seed", int, "seed of the frozen LoRA A"),
        ("group_size", int, "weights per scale of the 4-bit base linears (a multiple of 32)"),
    ):
        p.add_argument(
            cli_flag(field),
            dest=field,
            type=kind,
            help=text if "default" in text else text + " (default: the server's)",
        )
    p.add_argument(
        cli_flag("lr_schedule"),
        dest="lr_schedule",
        choices=SCHEDULES,
        help="lr over the steps after warm-up: constant, or linear / cosine decay from lr to the floor (default: "
        "the objective's, below); "
        "a federated job's schedule restarts in every round (each client runs --local-steps)",
    )
    p.add_argument("--targets", help="comma-separated module names (default q_proj,v_proj)")
    p.add_argument(cli_flag("program_backend"), dest="program_backend", choices=PROGRAM_BACKENDS)
    p.add_argument(cli_flag("quantize"), choices=QUANTIZATIONS, help="the program's frozen base linears (default none)")
    p.add_argument(
        cli_flag("parallel"),
        choices=PARALLEL_MODES,
        help="how a step runs its 2q paths: both (one pass, default), outer, inner or none (one at a time)",
    )
    p.add_argument(
        cli_flag("objective"),
        choices=OBJECTIVES,
        help=OBJECTIVE_HELP,
    )
    p.add_argument(
        cli_flag("optimizer"),
        choices=OPTIMIZERS,
        help="how g moves B in the program: sgd (default), momentum (beta 0.9) or normalized (by the recent rms of "
        "g); docs/method.md#optimizers-how-g-moves-b",
    )
    p.add_argument(cli_flag("probe_weights"), choices=PROBE_WEIGHTS, help=PROBE_WEIGHTS_HELP)
    p.add_argument(cli_flag("device_id"), dest="device_id", type=int, help="run on this device only")
    p.add_argument(cli_flag("device_backend"), choices=DEVICE_BACKENDS)
    p.add_argument(
        cli_flag("init_adapter_id"),
        dest="init_adapter_id",
        type=int,
        help="start from this adapter's B (yours, or a cohort's)",
    )
    p.add_argument(
        "--upload", choices=("full", "log"), help="full: the device sends B and its log (default); log: the log alone"
    )
    p.add_argument(
        "--standing",
        action="store_true",
        default=None,
        help="a standing job: a session each time an eligible device asks, from the promoted adapter (promoted: a "
        "lower held-out loss); see docs/guide/jobs.md",
    )
    p.add_argument("--sessions", type=int, help="a standing job: end after this many sessions (default: never)")
    dp = p.add_argument_group("private jobs (docs/guide/privacy.md: the device uploads noised g alone, no losses)")
    dp.add_argument("--dp-epsilon", type=float, help="(epsilon, delta)-DP for each of the device's examples")
    dp.add_argument("--dp-delta", type=float, help=f"delta (default {defaults.DP_DELTA:g})")
    dp.add_argument(
        "--dp-clip",
        type=float,
        help=f"C: each example's projected difference is clipped to [-C, C] (default {defaults.DP_CLIP:g})",
    )
    dp.add_argument(
        "--dp-min-examples",
        type=int,
        help="at least this many training examples on the device (required with --dp-epsilon: the accountant's "
        "sampling rate; a device with fewer refuses the job)",
    )
    fed = p.add_argument_group("federated jobs (--cohort; admin token; model and task come from the cohort)")
    fed.add_argument("--cohort", type=int, help="run federated rounds on this cohort's member devices")
    for field, kind, text in (
        ("rounds", int, "R: rounds"),
        ("clients_per_round", int, "K: a round closes when K clients reported"),
        ("local_steps", int, "N: each client's steps per round"),
        ("min_clients", int, "M: at the timeout a round closes with at least M reports (default K)"),
        ("round_timeout_s", float, "seconds from a round's first lease to its deadline"),
        ("trim_fraction", float, "trimmed-mean: the share cut at each end"),
        ("global_lr", float, "ETA in B_{r+1} = B_r + ETA * aggregate"),
        ("server_momentum", float, "BETA of momentum over rounds (FedAvgM): m = BETA*m + aggregate; default 0"),
        ("max_abs_g", float, "refuse a client log with any |g| above this"),
        ("max_staleness", int, "buffered: refuse a part leased more than this many versions back (default 4)"),
        ("concurrency", int, "buffered: at most this many parts in flight at once (default 2K)"),
    ):
        fed.add_argument(cli_flag(field), dest=field, type=kind, help=text)
    fed.add_argument("--aggregation", choices=("fedavg", "trimmed-mean", "median"), help="how deltas combine")
    fed.add_argument(
        "--mode",
        choices=("sync", "buffered"),
        help="sync: a round closes at K of its own reports; buffered: a version closes at every K verified arrivals, "
        "each weighted by its staleness (default sync)",
    )
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
    """The JobCreate (or, with ``--cohort``, FederatedJobCreate) body from the options; ``UsageError`` naming the
    field for anything the schema rejects."""
    import json

    from shared.errors import UsageError
    from shared.schemas import JobCreate

    if args.cohort is not None:
        return _federated_body(args)
    if args.model is None:
        raise UsageError("model", "required (or --cohort for a federated job)")
    stray = [f for f in ("local_steps", *_FEDERATION) if getattr(args, f, None) is not None]
    if stray:
        raise UsageError(stray[0], "applies to federated jobs only (--cohort)")
    body = {f: getattr(args, f) for f in _FIELDS if getattr(args, f, None) is not None}
    if args.targets is not None:
        body["targets"] = [t.strip() for t in args.targets.split(",") if t.strip()]
    if args.verbalizer is not None:
        try:
            body["verbalizer"] = json.loads(args.verbalizer)
        except json.JSONDecodeError as exc:
            raise UsageError("verbalizer", f"not JSON ({exc.msg})") from None
    body |= _privacy(args)
    return _validated(JobCreate, body, renamed={"privacy": "dp_min_examples"})  # what JobCreate checks of it


def _privacy(args: argparse.Namespace) -> dict:
    """``{"privacy": ...}`` from the ``--dp-*`` options, or nothing for a job that is not private."""
    from shared.errors import UsageError
    from shared.schemas import Privacy

    privacy = {name: getattr(args, f"dp_{name}") for name in _PRIVACY if getattr(args, f"dp_{name}") is not None}
    if not privacy:
        return {}
    for required in ("epsilon", "min_examples"):
        if required not in privacy:
            raise UsageError(f"dp_{required}", "required for a private job")
    return {"privacy": _validated(Privacy, privacy, renamed={name: f"dp_{name}" for name in _PRIVACY})}


def _validated(schema, body: dict, renamed: dict[str, str] | None = None) -> dict:
    """``body`` as ``schema`` accepts it, without what the options left out (the values the schema filled in
    from the defaults included: the server decides those); ``UsageError`` naming the first field it refuses
    (``renamed``: a schema field that this command's options call otherwise, e.g. a federated job's ``steps`` is
    ``local_steps``)."""
    from pydantic import ValidationError

    from shared.errors import UsageError, usage_error

    try:
        model = schema.model_validate(body)
        return model.model_dump(mode="json", exclude_unset=True, exclude=getattr(model, "defaulted", set()))
    except ValidationError as exc:
        error = usage_error(exc)
        raise UsageError((renamed or {}).get(error.field, error.field), error.reason) from None


def _federated_body(args: argparse.Namespace) -> dict:
    """The FederatedJobCreate body of ``--cohort``: hyperparameters, round settings, ``--local-steps`` as steps."""
    from shared.errors import UsageError
    from shared.schemas import FederatedJobCreate

    for field in (*_PERSONAL_ONLY, "upload"):
        if getattr(args, field, None) is not None:
            raise UsageError(field, "does not apply with --cohort")
    for required in ("rounds", "clients_per_round", "local_steps"):
        if getattr(args, required) is None:
            raise UsageError(required, "required with --cohort")
    body = {f: getattr(args, f) for f in (*_HYPER, *_FEDERATION) if getattr(args, f, None) is not None}
    body["steps"] = args.local_steps
    if args.targets is not None:
        body["targets"] = [t.strip() for t in args.targets.split(",") if t.strip()]
    body |= _privacy(args)
    return _validated(FederatedJobCreate, body, renamed={"steps": "local_steps", "privacy": "dp_min_examples"})


def _admin_token_default(args: argparse.Namespace) -> None:
    """A federated job is the admin's: unless a token was given explicitly, use ``$MOBIZO_ADMIN_TOKEN``."""
    import os

    if args.token_file is None and args.token == os.environ.get("MOBIZO_TOKEN"):
        args.token = os.environ.get("MOBIZO_ADMIN_TOKEN") or args.token


def run(args: argparse.Namespace) -> ExitCode:
    if args.action == "submit":
        body = job_body(args)
        if args.cohort is None:
            print_json(client_from_args(args).post("/v1/jobs", body))
        else:
            _admin_token_default(args)
            print_json(client_from_args(args).post(f"/v1/cohorts/{args.cohort}/jobs", body))
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
