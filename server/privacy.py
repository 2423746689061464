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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import HTTPException, status
from sqlalchemy.orm import Session

from server import accounts, queries
from server.settings import Settings
from server.tables import Job, User
from shared import defaults
from shared.schemas import TERMINAL_STATUSES, Privacy


def resolve(privacy: Privacy, steps: int, batch_size: int) -> Privacy:
    """The job's privacy with its noise multiplier (a few seconds of calibration, remembered per process) over
    ``steps`` (a federated job's: rounds × local steps); 422 naming ``privacy`` when the body set the multiplier."""
    from server.responses import field_error
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
    version the ledger was read at."""

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


def ledger(session: Session, user: User, settings: Settings, delta: float | None = None) -> Ledger:
    """The user's ledger as committed now (``delta``: read at this delta instead of the budget's)."""
    session.refresh(user)
    epsilon = user.privacy_epsilon if user.privacy_epsilon is not None else settings.privacy_budget_epsilon
    if delta is None:
        delta = user.privacy_delta if user.privacy_delta is not None else defaults.DP_DELTA
    jobs, parts = queries.private_jobs_of(session, user.id), queries.private_parts_of(session, user.id)
    return Ledger(epsilon, delta, user.privacy_version, jobs, parts)


def charge(user: User, settings: Settings, spec: dict[str, Any]) -> Callable[[Session], bool]:
    """The ledger entry of a private job (``spec``: its JSON, privacy resolved) for ``jobstate.submit``: refuses
    with 409 when the user's ledger would pass its budget; False when a racing submit claimed the ledger first."""

    def claim(session: Session) -> bool:
        book = ledger(session, user, settings)
        after = book.spent(spec)
        if after > book.epsilon:
            left = max(book.epsilon - book.spent(), 0.0)
            raise HTTPException(
                status.HTTP_409_CONFLICT,
                f"privacy budget: this job would bring your epsilon to {after:.3g} (delta {book.delta:g}), over "
                f"your budget of {book.epsilon:g}; {left:.3g} remains",
            )
        return accounts.claim_privacy_ledger(session, user.id, book.version)

    return claim


def claim_part(session: Session, user: User, settings: Settings, spec: dict[str, Any]) -> bool:
    """Whether the user's ledger has room for one part of a private federated job (``spec``), claiming it if so
    (the caller commits, with the part): a part over the member's budget is not leased to any of its devices."""
    book = ledger(session, user, settings)
    return book.spent(spec) <= book.epsilon and accounts.claim_privacy_ledger(session, user.id, book.version)
