"""Private jobs on the server: the noise a job's (epsilon, delta) needs, and each user's privacy ledger.

At submit the server fixes a private job's noise multiplier sigma (``shared.privacy.noise_multiplier``: the job's
steps, each a sample of ``batch_size`` of the ``min_examples`` the user states), so the device, the result checks
and the ledger use one value. The ledger composes every private job of the user that may have touched data — all
but those that ended before any device leased them — with one accountant (``shared.privacy.ledger_epsilon``) and
reads epsilon at the budget's delta. A job that would take the total past the budget is refused (409, naming what
remains). Two submits of one user racing for the rest of a budget are serialized by the user's ledger version
(``accounts.claim_privacy_ledger``): the one that loses its claim reads the ledger again, with the winner's job in
it. The budget is the user's (``PUT /v1/privacy``), else ``Settings.privacy_budget_epsilon`` at
``shared.defaults.DP_DELTA``.

A cohort keeps a ledger of the same kind (``PUT /v1/cohorts/{id}/privacy``, the admin's): its private federated
jobs, each (epsilon, delta)-DP for any member's data over all of its rounds, composed the same way; a federated
job that would take the cohort past its budget is refused at submit. Each member's own ledger still counts the
parts its devices take (``claim_part``), so a member in several cohorts is bounded by both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import HTTPException, status
from sqlalchemy.orm import Session

from server import accounts, queries
from server.responses import field_error
from server.settings import Settings
from server.tables import Cohort, Job, User
from shared import defaults
from shared.schemas import TERMINAL_STATUSES, Privacy, PrivacyBudget, PrivacyEntry, PrivacyLedgerPublic


def resolve(privacy: Privacy, steps: int, batch_size: int) -> Privacy:
    """The job's privacy with its noise multiplier (a few seconds of calibration, remembered per process) over
    ``steps`` (a federated job's: rounds × local steps); 422 naming ``privacy`` when the body set the multiplier."""
    from shared.privacy import noise_multiplier

    if privacy.noise_multiplier is not None:
        raise field_error("privacy", "noise_multiplier is set by the server from epsilon and delta")

    sigma = noise_multiplier(privacy.epsilon, privacy.delta, steps, batch_size, privacy.min_examples)
    return privacy.model_copy(update={"noise_multiplier": sigma})


def spends(job: Job) -> bool:
    """Whether a private job counts against the ledger: it may have touched data (it was leased, or may still be)."""
    return not (job.status in TERMINAL_STATUSES and job.attempts == 0)


def _run(spec: dict[str, Any]) -> tuple[float, int, int, int]:
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

    def spent(self, extra: dict[str, Any] | None = None) -> float:
        """Epsilon at the budget's delta of the jobs that spend and the parts (and of a job or part ``extra``'s
        spec, to be added): one composition by the accountant."""
        from shared.privacy import ledger_epsilon

        runs = [_run(job.spec) for job in self.jobs if spends(job)] + [_run(part.spec) for part in self.parts]
        return ledger_epsilon(runs + ([_run(extra)] if extra else []), self.delta)


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
    """The ledger entry of a private job (``spec``: its JSON, privacy resolved) for ``jobstate.submit``: refuses
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
