"""Checking an uploaded result, the one home of what a valid result is: then packaging it as a PEFT archive.

In the request (cheap, no torch; bad tensors are rejected before a worker is asked to replay): the size limits
(``b_limit``, ``log_limit``, ``METRICS_LIMIT``), the B file's layout and values (``check_b``), the log's line
count against the job's steps (``check_step_count``) and the metrics (``parse_metrics``, ``UploadMetrics``). In a
worker process (``server.pool.WorkerPool``; torch is imported inside the functions): the log's checks against the
job, the replay of the log from the starting B with the job's optimizer, each step within that optimizer's bound
on how far it moves B (``replayed``), compared with the upload bit for bit, except for devices running eager torch
(``exact_replay``), and the archive of the *replayed* B (``verify_and_package``): the registry stores the replay,
so stored B == replay(stored log) for every adapter. Arguments and results of the worker side are plain data, so
they pickle.

Rejections raise ``ResultRejected(field, message)``: picklable, so a worker can raise it too, and turned into a
422 naming the part by the route.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import ValidationError

from shared import defaults
from shared.b_file import b_file_bytes, read_b_file
from shared.errors import DataError
from shared.manifest import ProgramManifest
from shared.schemas import MAX_LOSS, PRIVATE_METRICS, AdapterPrompt, JobSpec, UploadMetrics
from shared.train_log import step_losses

METRICS_LIMIT = 1 << 20
_LOG_LINE_BYTES = 512  # step, seed, lr, eps and punctuation, generously
_FLOAT_BYTES = 32  # one float written with repr() and a separator
REPLAY_RTOL = 1e-4
REPLAY_ATOL = 1e-6
G_RTOL = 1e-5  # g against (l+ - l-) / (2 eps): float32 rounding of the logged losses, with room to spare
_ZIP_DATE = (1980, 1, 1, 0, 0, 0)


class ResultRejected(ValueError):
    """An upload that is not a valid result for its job; nothing of it is stored."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(field, message)
        self.field = field
        self.message = message

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


def b_size(manifest: dict[str, Any]) -> int:
    """D, the length of b_flat, as the program's manifest states it."""
    return ProgramManifest.model_validate(manifest).lora_size


def b_limit(d: int) -> int:
    """Largest acceptable B file: the tensor plus a small header."""
    return 4 * d + 4096


def log_limit(spec: JobSpec) -> int:
    """Largest acceptable log: one line per step with 3q floats."""
    return spec.steps * (_LOG_LINE_BYTES + 3 * spec.q * _FLOAT_BYTES) + 4096


def check_b(path: Path, d: int) -> None:
    """A B file (``shared.b_file``): exactly one tensor ``b_flat``, float32, shape [D], every value finite."""
    try:
        read_b_file(path, d)
    except DataError as exc:
        raise ResultRejected("b_flat", str(exc)) from None


def _no_constants(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def _json_problem(exc: Exception) -> str:
    """Why ``json.loads`` refused a part, in words that quote none of it."""
    if isinstance(exc, json.JSONDecodeError):
        return exc.msg
    if isinstance(exc, UnicodeDecodeError):
        return "not UTF-8"
    if isinstance(exc, RecursionError):
        return "nested too deep"
    return "NaN, Infinity or a number too long to read"


def parse_metrics(data: bytes, private: bool = False) -> dict[str, Any]:
    """The metrics part as ``UploadMetrics`` validates it, in the form stored (unknown keys dropped, JSON-safe). A
    private job's (``private``) carries no losses and no held-out figures: they are functions of the device's data
    that no noise covers, so the server refuses them; of the rest it keeps only ``PRIVATE_METRICS``, the job's own
    parameters (an honest agent sends more: its timings, its free text, which are dropped, not refused)."""
    try:
        raw = json.loads(data, parse_constant=_no_constants)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise ResultRejected("metrics", f"not JSON ({_json_problem(exc)})") from None
    if not isinstance(raw, dict):
        raise ResultRejected("metrics", "must be a JSON object")
    try:
        metrics = UploadMetrics.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p)[:64] for p in first["loc"])  # a key is the client's: only its start
        raise ResultRejected("metrics", f"{where}: {first['msg']} ({exc.error_count()} errors)") from None
    if private and metrics.losses is not None:
        raise ResultRejected("metrics", "losses: a private job's losses stay on the device")
    if private and metrics.eval:
        raise ResultRejected("metrics", "eval: a private job's held-out figures stay on the device")
    return metrics.model_dump(mode="json", exclude_unset=True, include=set(PRIVATE_METRICS) if private else None)


def replay_tolerance(max_abs_b: float) -> float:
    """Largest accepted max |uploaded B - replayed B| from a device running eager torch: 1e-4 of max|B| plus 1e-6.

    The ExecuTorch program and the replay agree bit for bit (the noise is integer arithmetic and the update is
    the same float32 expression), so ExecuTorch devices get no slack at all; eager torch on other hardware may
    round a few ulps differently, while a forged or wrong B is off by far more. Either way the server stores the
    replayed B, so the registry always holds what the stored log gives.
    """
    return REPLAY_RTOL * max_abs_b + REPLAY_ATOL


# How each device backend's B is held to the replay, by name: a backend the server has no entry for is refused
# (``exact_replay`` raises), never assumed to be either. "exact": the program's arithmetic is the replay's, float32
# op for op with no fused multiply-adds, shown bit for bit on x86-64 (the ExecuTorch runtime, the native runner) and
# on aarch64 (the runner's self-contained bundle, under qemu: tests/device_agent/test_aarch64.py). "tolerance":
# eager torch, which may run on any hardware and kernels (``replay_tolerance``).
REPLAY_CHECK: dict[str, str] = {"executorch": "exact", "adb": "exact", "native": "exact", "torch": "tolerance"}


def exact_replay(device_backend: str) -> bool:
    """Whether a device's B must equal the replay bit for bit (``REPLAY_CHECK``); ValueError for a backend with no
    entry there."""
    try:
        return REPLAY_CHECK[device_backend] == "exact"
    except KeyError:
        raise ValueError(f"no replay check is known for the device backend {device_backend!r}") from None


def count_log_lines(path: Path) -> int:
    """Non-blank lines of the spooled log, counted without parsing: the cheap step check before any worker."""
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def check_step_count(log_path: Path, spec: JobSpec) -> None:
    """No more log lines than the job has steps, before a worker parses or replays anything (a shorter log is
    refused by the worker's parse, which says what is wrong with it)."""
    lines = count_log_lines(log_path)
    if lines > spec.steps:
        raise ResultRejected("log", f"{lines} steps logged, the job has {spec.steps}")


def _load_b(path: str | None, d: int):
    """B of a B file (``shared.b_file``; checked when it was received), or zeros for a job without a start."""
    import torch

    return torch.zeros(d, dtype=torch.float32) if path is None else torch.from_numpy(read_b_file(Path(path), d))


def _check_g(rec: dict, eps: float, where: str, probe_weights: str = "none") -> None:
    """Each g_i is what its two losses say, (l+ - l-) / (2 eps) in float32 (``shared.zo.projected_gradients``),
    within float32 rounding of the losses: this bounds |g| by the losses, so a log cannot push B arbitrarily far.
    ``curvature`` (losses +, -, clean per query): that times the probe's weight (``shared.zo.curvature_weights``,
    recomputed here from the logged losses; at most 1, and within an ulp of the device's, which the tolerance
    covers)."""
    losses = np.asarray(rec["losses"], dtype=np.float32)
    g = np.asarray(rec["g"], dtype=np.float64)
    weights = np.ones(len(g))
    if probe_weights == "curvature":
        import torch

        from shared.zo import curvature_weights

        eps_t = torch.tensor([np.float32(eps)], dtype=torch.float32)
        weights = curvature_weights(torch.from_numpy(losses), eps_t).numpy()
        losses = losses.reshape(-1, 3)[:, :2].reshape(-1)
    expected = (losses[0::2] - losses[1::2]) / (np.float32(eps) * np.float32(2)) * weights
    scale = (np.abs(losses[0::2]) + np.abs(losses[1::2])).astype(np.float64) / (2 * eps) * weights
    if not (np.abs(g - expected) <= G_RTOL * scale).all():
        rule = "(l+ - l-) / (2 eps)" + (" times its curvature weight" if probe_weights == "curvature" else "")
        raise ResultRejected("log", f"{where}: g does not follow from the losses, {rule}")


def expected_lr(spec: dict[str, Any], step: int) -> float:
    """The float32 lr the job's schedule gives ``step`` (``shared.schedule.lr_at``) times its optimizer's factor
    (``shared.zo_optim.step_lr``), as the device computed it."""
    from shared.schedule import lr_at
    from shared.zo_optim import step_lr

    scheduled = lr_at(
        spec["lr"],
        spec["steps"],
        step,
        spec.get("lr_schedule", defaults.LR_SCHEDULE),
        spec.get("warmup_steps", defaults.WARMUP_STEPS),
        spec.get("lr_floor", defaults.LR_FLOOR),
    )
    return step_lr(optimizer(spec), scheduled, step)


def optimizer(spec: dict[str, Any]) -> str:
    """The job's optimizer (a spec stored before there were optimizers: sgd)."""
    return spec.get("optimizer") or "sgd"


def replayed(init_b, log: list[dict], spec: dict[str, Any]):
    """B after the checked ``log``, replayed with the job's optimizer, each step within that optimizer's bound
    (``shared.zo_optim.step_bound``) or ``ResultRejected``."""
    from shared.replay import OutOfBounds, replay_state

    try:
        return replay_state(init_b, log, optimizer(spec), check=True)[0]
    except OutOfBounds as exc:
        raise ResultRejected("log", str(exc)) from None


def _check_record(rec: dict, index: int, spec: dict[str, Any], max_abs_g: float | None = None) -> None:
    from shared.noise import step_seed

    where = f"step {index}"
    if type(rec["step"]) is not int or rec["step"] != index:
        raise ResultRejected("log", f"line {index + 1}: step must be {index} (steps count from 0)")
    if type(rec["seed"]) is not int:
        raise ResultRejected("log", f"{where}: seed must be an integer")
    lr = expected_lr(spec, index)
    if np.float32(rec["lr"]) != np.float32(lr):  # the replay takes lr as float32: those bits must be the schedule's
        schedule = spec.get("lr_schedule", defaults.LR_SCHEDULE)
        raise ResultRejected("log", f"{where}: lr must be the job's {schedule} schedule's {lr!r}")
    if np.float32(rec["eps"]) != np.float32(spec["eps"]):
        raise ResultRejected("log", f"{where}: eps must be the job's {spec['eps']}")
    if len(rec["g"]) != spec["q"]:
        raise ResultRejected("log", f"{where}: needs q={spec['q']} values of g")
    if not spec.get("privacy"):  # a private log has no losses: its g are bounded by private_g_bound instead
        paths = 3 if spec.get("probe_weights") == "curvature" else 2  # a curvature step's clean path per query
        if len(rec["losses"]) != paths * spec["q"]:
            raise ResultRejected("log", f"{where}: needs {paths * spec['q']} losses")
        losses = np.asarray(rec["losses"], dtype=np.float64)
        if not (np.isfinite(losses).all() and (losses >= 0).all() and (losses <= MAX_LOSS).all()):
            raise ResultRejected("log", f"{where}: a loss is not a finite number in [0, {MAX_LOSS:g}]")
        _check_g(rec, spec["eps"], where, spec.get("probe_weights") or "none")
    if rec["seed"] != step_seed(spec["seed"], rec["step"]):
        raise ResultRejected("log", f"{where}: seed must be the job's seed for this step")
    if max_abs_g is not None and not (np.abs(np.asarray(rec["g"], dtype=np.float64)) <= max_abs_g).all():
        raise ResultRejected("log", f"{where}: a |g| is above the bound {max_abs_g:g}")


def private_g_bound(spec: dict[str, Any]) -> float:
    """The largest |g| of an honest private log of the job (``shared.privacy.g_bound``: the clip plus the noise's
    tail, at a 1e-9 chance of refusing an honest log)."""
    from shared.privacy import g_bound

    p = spec["privacy"]
    return g_bound(p["clip"], p["noise_multiplier"], spec["batch_size"] // spec["q"], spec["steps"] * spec["q"])


def read_checked_log(log_path: str, spec: dict[str, Any], max_abs_g: float | None = None) -> list[dict]:
    """The log's records (``shared.train_log.parse_log``), checked against the job: steps 0, 1, … steps-1, integer
    seeds of the job, the lr of its schedule at each step (``expected_lr``), its eps, q values of g that follow from
    their losses (and within ``max_abs_g``); a private job's: no losses, and every |g| within
    ``private_g_bound``."""
    from shared.train_log import parse_log

    private = bool(spec.get("privacy"))
    if private:
        bound = private_g_bound(spec)
        max_abs_g = bound if max_abs_g is None else min(max_abs_g, bound)
    try:
        log = parse_log(Path(log_path).read_text(encoding="utf-8"), "log", private=private)
    except (DataError, UnicodeDecodeError) as exc:
        raise ResultRejected("log", str(exc)) from None
    if len(log) != spec["steps"]:
        raise ResultRejected("log", f"{len(log)} steps logged, the job has {spec['steps']}")
    for index, rec in enumerate(log):
        _check_record(rec, index, spec, max_abs_g)
    return log


def _replayed_b(
    init_path: str | None, b_path: str, log: list[dict], spec: dict[str, Any], d: int, exact: bool, out: Path
) -> dict:
    """Replay the log, compare with the upload (bit for bit when ``exact``) and save the replay as ``out``."""
    import torch

    uploaded = _load_b(b_path, d)
    b = replayed(_load_b(init_path, d), log, spec)
    diff = float((b - uploaded).abs().max())
    if exact:
        if not torch.equal(b.view(torch.int32), uploaded.view(torch.int32)):
            raise ResultRejected("b_flat", f"does not match the replay of the log bit for bit (max |diff| {diff:.3g})")
        tolerance = 0.0
    else:
        tolerance = replay_tolerance(float(uploaded.abs().max()))
        if not diff <= tolerance:
            raise ResultRejected(
                "b_flat", f"does not match the replay of the log: max |diff| {diff:.3g} > tolerance {tolerance:.3g}"
            )
    out.write_bytes(b_file_bytes(b.numpy()))
    return {"replay_max_abs_diff": diff, "replay_tolerance": tolerance}


def _zip_dir(src: Path, archive: Path) -> None:
    """A deterministic zip (sorted names, fixed dates), so the same adapter always hashes the same."""
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as zf:
        for path in sorted(p for p in src.rglob("*") if p.is_file()):
            info = zipfile.ZipInfo(path.relative_to(src).as_posix(), _ZIP_DATE)
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, path.read_bytes())


def base_of(model) -> dict[str, str]:
    """What packaging needs of the job's model (a ``Model`` row): its registered name and ``model_sha256``, which
    the archive pins (``shared.adapter.BASE_FILE``)."""
    return {"base_model": model.name, "base_sha256": model.sha256}


def adapter_prompt(job, manifest: dict[str, Any]) -> AdapterPrompt:
    """How a job's adapter must be prompted: its spec's template and verbalizer; its program's chat frame,
    objective and calibration prior."""
    spec, config = job.spec, manifest["config"]
    chat = config.get("chat")
    return AdapterPrompt(
        task=spec.get("task") or "custom",
        template=spec.get("template"),
        verbalizer=spec.get("verbalizer"),
        chat=None if chat is None else list(chat),
        objective=config.get("objective", "lm"),
        prior=list(config.get("prior") or []),
    )


def card_of(job, manifest: dict[str, Any], backend: str | None = None) -> dict[str, Any]:
    """The archive's card (``shared.adapter.write_card``) of a job (a ``Job`` row) and its program's manifest: the
    prompt contract it trained with (its spec's template, verbalizer and chat frame; the program's objective and
    calibration prior) and its provenance (the job, its steps, the device's backend, privacy, federation)."""
    from shared.adapter import make_card

    spec, prompt = job.spec, adapter_prompt(job, manifest)
    return make_card(
        prompt.task,
        prompt.template,
        prompt.verbalizer,
        prompt.chat is not None,
        prompt.objective,
        prompt.prior,
        job_id=job.id,
        steps=spec.get("steps"),
        device_backend=backend,
        federated=job.cohort_id is not None,
        dp_epsilon=(spec.get("privacy") or {}).get("epsilon"),
        replay_verified=True,
    )


def package_adapter(job: dict[str, Any], b_path: str, out_dir: str) -> str:
    """Write the PEFT archive (A regenerated from the seed, B from ``b_path``) → path of the zip."""
    from shared.adapter import save_program_adapter

    adapter_dir = Path(out_dir) / "adapter"
    manifest = ProgramManifest.model_validate(job["manifest"])
    b = _load_b(b_path, job["d"])
    save_program_adapter(adapter_dir, manifest, b, job["base_model"], job.get("base_sha256"), job.get("card"))
    archive = Path(out_dir) / "adapter.zip"
    _zip_dir(adapter_dir, archive)
    return str(archive)


def verify_and_package(
    job: dict[str, Any], b_path: str | None, log_path: str, init_path: str | None, out_dir: str
) -> dict:
    """Check the log, replay it from the starting B and compare with the upload; save the replayed B (the one
    stored) and build the PEFT archive from it → ``{"b_flat": path, "archive": path, **checks}``. With no uploaded
    B (``b_path`` None: a log-only upload) the replay is the result.

    ``job`` holds ``spec`` (JobSpec as JSON), ``manifest``, ``d``, ``base_of`` the job's model (the base the archive
    pins) and ``exact`` (bit-for-bit replay required, ``exact_replay``). Raises ``ResultRejected`` for a log that is
    malformed, does not belong to the job, or does not reproduce the uploaded B.
    """
    if b_path is None:
        checks = replay_log_only(job, log_path, init_path, out_dir)
        stored_b = Path(checks.pop("b_flat"))
    else:
        log = read_checked_log(log_path, job["spec"])
        stored_b = Path(out_dir) / "replayed_b_flat"
        checks = _replayed_b(init_path, b_path, log, job["spec"], job["d"], job["exact"], stored_b)
        checks["losses"] = step_losses(log)
    return {"b_flat": str(stored_b), "archive": package_adapter(job, str(stored_b), out_dir), **checks}


def replay_log_only(job: dict[str, Any], log_path: str, init_path: str | None, out_dir: str) -> dict:
    """A log-only upload (a round client's, or a personal job's with ``upload: log``): check the log, replay it from
    the starting B and save the replay, which *is* the result → ``{"b_flat": path, "replay_s", "mean_loss"}``.

    Replay proves what the log means, not that its g were honestly measured: the log checks, ``max_abs_g`` (in
    ``job``, optional) and a robust aggregation are the defences against a lying client.
    """
    import time

    log = read_checked_log(log_path, job["spec"], job.get("max_abs_g"))
    start = time.perf_counter()
    b = replayed(_load_b(init_path, job["d"]), log, job["spec"])
    seconds = time.perf_counter() - start
    out = Path(out_dir) / "replayed_b_flat"
    out.write_bytes(b_file_bytes(b.numpy()))
    losses = [loss for rec in log for loss in rec.get("losses", ())]  # a private log has none
    mean_loss = float(np.mean(losses)) if losses else None
    return {"b_flat": str(out), "replay_s": seconds, "mean_loss": mean_loss, "losses": step_losses(log)}
