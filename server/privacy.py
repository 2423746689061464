"""Private jobs on the server: the noise a job's (epsilon, delta) needs, and each user's privacy ledger.

At submit the server fixes a private job's noise multiplier sigma (``shared.accounting.noise_multiplier``: the job's
steps, each a sample of ``batch_size`` of the ``min_examples`` the user states), so the device, the result checks
and the ledger use one value. The ledger composes every private job of the user that may have touched data — all
but those that ended before any device leased them — with one accountant (``shared.accounting.ledger_epsilon``) and
reads epsilon at the budget's delta. A job that would take the total past the budget is refused (409, naming what
remains). Two submits of one user racing for the rest of a budget are serialized by the user's ledger version
(``accounts.claim_privacy_ledger``): the one that loses its claim reads the ledger again, with the winner's job in
it. The budget is the user's (``PUT /v1/privacy``), else ``Settings.privacy_budget_epsilon`` at
``shared.defaults.DP_DELTA``.

A private submit costs the API process little (``resolve``): the ledger is read first, and a ledger with nothing
left refuses the job (409) before any calibration; sigma's calibration (seconds of CPU) and each run's RDP curve
(a tenth of a second) are computed in a worker process of the ``Accountant`` and remembered in this process by their
inputs, so the ledger's composition here is a sum of remembered curves. One user (or cohort) has at most
``Settings.private_submits_per_user`` private submits in progress in a process; one more is refused at once (429
with Retry-After), so that one tenant's submits queue in the worker behind no more than that.

A cohort keeps a ledger of the same kind (``PUT /v1/cohorts/{id}/privacy``, the admin's): its private federated
jobs, each (epsilon, delta)-DP for any member's data over all of its rounds, composed the same way; a federated
job that would take the cohort past its budget is refused at submit. Each member's own ledger still counts the
parts its devices take (``claim_part``), so a member in several cohorts is bounded by both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi import HTTPException, status
from sqlalchemy.orm import Session

from server import accounts, queries
from server.pool import OwnerBusy, OwnerLimit, WorkerDied, WorkTimedOut
from server.responses import field_error, try_later
from server.settings import Settings
from server.tables import Cohort, Job, User
from shared import accounting, defaults
from shared.schemas import TERMINAL_STATUSES, Privacy, PrivacyBudget, PrivacyEntry, PrivacyLedgerPublic

ACCOUNTANT_PRELOAD = ("shared.accounting", "dp_accounting.rdp", "dp_accounting.mechanism_calibration")
SUBMIT_RETRY_S = 5  # a calibration takes seconds: a refused private submit is asked to come back after about one


class Pool(Protocol):
    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> Any: ...

    def close(self) -> None: ...


class Accountant:
    """The privacy arithmetic of private submits, off the request path: a calibration and a run's RDP curve are
    computed in ``pool`` (worker processes below the API's priority, ``server.pool``) and remembered in this
    process by their inputs (``shared.accounting``); ``submitting`` bounds one owner's private submits at once."""

    def __init__(self, pool: Pool, per_owner: int, timeout_s: float) -> None:
        self.pool = pool
        self.timeout_s = timeout_s
        self.per_owner = per_owner
        self._submits = OwnerLimit(per_owner)

    @contextmanager
    def submitting(self, owner: User | Cohort | None) -> Iterator[None]:
        """One of ``owner``'s places for private submits for the block (None: not a private submit, no bound);
        429 with Retry-After at once when every place is taken."""
        if owner is None:
            yield
            return
        try:
            with self._submits.hold((type(owner).__name__, owner.id)):
                yield
        except OwnerBusy:
            raise try_later(
                status.HTTP_429_TOO_MANY_REQUESTS,
                f"{_whose(owner)} private submits in progress are at the bound ({self.per_owner}): retry after "
                "Retry-After",
                SUBMIT_RETRY_S,
            ) from None

    def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return self.pool.run(fn, *args, timeout=self.timeout_s)
        except ValueError as exc:  # the accountant's refusal of the numbers themselves
            raise field_error("privacy", str(exc)) from None
        except (WorkTimedOut, WorkerDied) as exc:
            raise try_later(
                status.HTTP_503_SERVICE_UNAVAILABLE, f"the privacy accountant did not answer: {exc}", SUBMIT_RETRY_S
            ) from None

    def noise_multiplier(self, epsilon: float, delta: float, steps: int, batch_size: int, examples: int) -> float:
        """sigma for the target (remembered here, or calibrated in a worker)."""
        key = (epsilon, delta, steps, batch_size, examples)
        sigma = accounting.known_noise_multiplier(key)
        if sigma is None:
            sigma = self._run(accounting.noise_multiplier, *key)
            accounting.remember_noise_multiplier(key, sigma)
        return sigma

    def know(self, runs: list[accounting.Run]) -> None:
        """Have the RDP curve of every run here (those not known yet computed in a worker, in one round trip)."""
        missing = sorted({run for run in runs if accounting.known_rdp(run) is None})
        if missing:
            for run, curve in zip(missing, self._run(accounting.run_rdps, missing), strict=True):
                accounting.remember_rdp(run, curve)

    def close(self) -> None:
        self.pool.close()


def resolve(
    session: Session,
    accountant: Accountant,
    owner: User | Cohort,
    settings: Settings,
    privacy: Privacy,
    steps: int,
    batch_size: int,
) -> Privacy:
    """The job's privacy with its noise multiplier over ``steps`` (a federated job's: rounds × local steps), the
    owner's ledger checked first: with nothing left in it the job is refused (409) before any calibration. 422 naming
    ``privacy`` when the body set the multiplier. The new run's RDP curve is known here afterwards, so the charge
    (``charge``) composes remembered curves only."""
    if privacy.noise_multiplier is not None:
        raise field_error("privacy", "noise_multiplier is set by the server from epsilon and delta")
    book = ledger(session, owner, settings)
    accountant.know(book.runs())
    if (spent := book.spent()) >= book.epsilon:  # any job adds to it: refused without calibrating this one
        whose = _whose(owner)
        raise HTTPException(
            status.HTTP_409_CONFLICT,
            f"privacy budget: {whose} private jobs spent epsilon {spent:.3g} (delta {book.delta:g}) of {whose} "
            f"budget of {book.epsilon:g}; nothing remains",
        )
    sigma = accountant.noise_multiplier(privacy.epsilon, privacy.delta, steps, batch_size, privacy.min_examples)
    accountant.know([(sigma, steps, batch_size, privacy.min_examples)])
    return privacy.model_copy(update={"noise_multiplier": sigma})


def spends(job: Job) -> bool:
    """Whether a private job counts against the ledger: it may have touched data (it was leased, or may still be)."""
    return not (job.status in TERMINAL_STATUSES and job.attempts == 0)


def _run(spec: dict[str, Any]) -> accounting.Run:
    p = spec["privacy"]
    return p["noise_multiplier"], spec["steps"], spec["batch_size"], p["min_examples"]


@dataclass
class Ledger:
    """A user's budget, what their private jobs and the private round parts their devices took spent, and the
    version the ledger was read at; or a cohort's budget and its private federated jobs (no parts)."""

    epsilon: float
    delta: float
    version: int
    jobs: list[Job] = field(default_factory=list)
    parts: list = field(default_factory=list)  # the private round parts taken (``queries.private_parts_of``)

    def runs(self) -> list[accounting.Run]:
        """(noise multiplier, steps, batch size, examples) of the jobs that spend and of the parts."""
        return [_run(job.spec) for job in self.jobs if spends(job)] + [_run(part.spec) for part in self.parts]

    def spent(self, extra: dict[str, Any] | None = None) -> float:
        """Epsilon at the budget's delta of the jobs that spend and the parts (and of a job or part ``extra``'s
        spec, to be added): one composition by the accountant (of remembered curves: a run this process has not seen
        yet is computed here, once)."""
        return accounting.ledger_epsilon(self.runs() + ([_run(extra)] if extra else []), self.delta)


def ledger(session: Session, owner: User | Cohort, settings: Settings, delta: float | None = None) -> Ledger:
    """The ledger of a user or a cohort as committed now (``delta``: read at this delta instead of the budget's)."""
    session.refresh(owner)
    epsilon = owner.privacy_epsilon if owner.privacy_epsilon is not None else settings.privacy_budget_epsilon
    if delta is None:
        delta = owner.privacy_delta if owner.privacy_delta is not None else defaults.DP_DELTA
    parts = [] if isinstance(owner, Cohort) else queries.private_parts_of(session, owner.id)
    return Ledger(epsilon, delta, owner.privacy_version, queries.private_jobs_of(session, owner), parts)


def _whose(owner: User | Cohort) -> str:
    return f"cohort {owner.name}'s" if isinstance(owner, Cohort) else "your"


def charge(owner: User | Cohort, settings: Settings, spec: dict[str, Any]) -> Callable[[Session], bool]:
    """The ledger entry of a private job (``spec``: its JSON, privacy resolved) for ``state.jobs.submit``: refuses
    with 409 when the ledger of the user (or the cohort, for a federated job) would pass its budget; False when a
    racing submit claimed the ledger first. The ledger is read, the read ended, and the accountant's composition
    run with no transaction open: another tenant's requests never wait on it for SQLite's write lock. The
    claim that follows bumps the version only if it is still the one read (``accounts.claim_privacy_ledger``)."""
    whose = _whose(owner)

    def claim(session: Session) -> bool:
        book = ledger(session, owner, settings)  # read in autocommit: no transaction while the accountant composes
        after = book.spent(spec)
        if after > book.epsilon:
            left = max(book.epsilon - book.spent(), 0.0)
            raise HTTPException(
                status.HTTP_409_CONFLICT,
                f"privacy budget: this job would bring {whose} epsilon to {after:.3g} (delta {book.delta:g}), over "
                f"{whose} budget of {book.epsilon:g}; {left:.3g} remains",
            )
        return accounts.claim_privacy_ledger(session, owner, book.version)

    return claim


def _entry(job_id: int, status: str, spec: dict, spends: bool, round_: int | None = None) -> PrivacyEntry:
    """A ledger line: a private job, or (``round_`` set) a part of a private federated job."""
    p = Privacy.model_validate(spec["privacy"])
    return PrivacyEntry(
        job_id=job_id,
        status=status,
        steps=spec["steps"],
        batch_size=spec["batch_size"],
        privacy=p,
        spends=spends,
        round=round_,
    )


def public(book: Ledger) -> PrivacyLedgerPublic:
    """A ledger as the API shows it (``GET /v1/privacy``, ``GET /v1/cohorts/{id}/privacy``)."""
    spent = book.spent()
    entries = [_entry(job.id, job.status, job.spec, spends(job)) for job in book.jobs]
    entries += [_entry(part.id, part.status, part.spec, True, part.index) for part in book.parts]
    budget = PrivacyBudget(epsilon=book.epsilon, delta=book.delta)
    return PrivacyLedgerPublic(budget=budget, spent=spent, remaining=max(book.epsilon - spent, 0.0), jobs=entries)


def set_budget(
    session: Session, owner: User | Cohort, settings: Settings, budget: PrivacyBudget
) -> PrivacyLedgerPublic:
    """Set the budget of a user or a cohort (committed) and show the ledger; 409 naming ``epsilon`` when the budget
    is below what its private jobs spent already."""
    if (spent := ledger(session, owner, settings, budget.delta).spent()) > budget.epsilon:
        detail = f"{_whose(owner)} private jobs spent {spent:.3g} at delta {budget.delta:g}"
        raise field_error("epsilon", detail, status.HTTP_409_CONFLICT)
    accounts.set_privacy_budget(session, owner, budget.epsilon, budget.delta)
    return public(ledger(session, owner, settings))


def claim_part(session: Session, user: User, settings: Settings, spec: dict[str, Any]) -> bool:
    """Whether the user's ledger has room for one part of a private federated job (``spec``), claiming it if so
    (the caller commits, with the part): a part over the member's budget is not leased to any of its devices."""
    book = ledger(session, user, settings)
    return book.spent(spec) <= book.epsilon and accounts.claim_privacy_ledger(session, user, book.version)
