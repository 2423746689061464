"""A round's close (``server.state``'s transaction rule, the round's states in ``server.state.rounds``): one
attempt at a time takes an open round to closing, stamped, and then to closed with the next version, back to open,
or to failed; a stopped server's or a dead process's close is given back to the sweeper. At the timeout with fewer
than M reports a round is reopened once, then failed.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    and_,
    or_,
    select,
    update,
)
from sqlalchemy.orm import Session

from server import registry
from server.db import begin_write
from server.state.jobs import fail
from server.state.rounds import buffered
from server.tables import (
    Job,
    Round,
    RoundClient,
    utcnow,
)


class CloseTakenOver(Exception):
    """The round is no longer closing under this attempt: it was given up as stale and another close took it."""


def begin_close(session: Session, round_id: int) -> datetime | None:
    """open → closing → the attempt's stamp (``closing_at``), or None when another request or sweep is closing the
    round: only one aggregates it. The later transitions of the close name the stamp."""
    begin_write(session)
    now = utcnow()
    moved = session.execute(
        update(Round).where(Round.id == round_id, Round.status == "open").values(status="closing", closing_at=now)
    ).rowcount
    session.commit()
    return now if moved else None


def _closing(round_: Round, closing_at: datetime) -> Any:
    return and_(Round.id == round_.id, Round.status == "closing", Round.closing_at == closing_at)


def finish_close(
    session: Session,
    round_: Round,
    closing_at: datetime,
    files: registry.StoredFiles,
    metrics: dict[str, Any],
    counted: list[int],
    next_momentum: str | None = None,
) -> None:
    """closing → closed with its adapter, the cohort's next version (``files``: B_{r+1} and the round's record;
    ``metrics``); the reports it aggregated (``counted``, client ids) say so; the next round opens from B_{r+1} and
    ``next_momentum`` (m_{r+1}, server-side momentum), or after the last round the job succeeds. Leased clients left
    behind are stragglers: expired (a buffered job's only once the next version would find them more than
    ``max_staleness`` old). Commits; raises ``CloseTakenOver`` when this attempt no longer holds the round, and
    on that or any other error nothing is written (rolled back)."""
    begin_write(session)
    try:
        job = session.get_one(Job, round_.job_id)
        adapter = registry.add_cohort_version(session, job, round_, files, metrics)
        now = utcnow()
        stats = {"mean_loss": metrics["mean_loss"], "aggregate_s": metrics["aggregate_s"]}
        moved = session.execute(
            update(Round)
            .where(_closing(round_, closing_at))
            .values(status="closed", adapter_id=adapter.id, closed_at=now, **stats)
        ).rowcount
        if not moved:
            raise CloseTakenOver(f"round {round_.index} of job {round_.job_id} was taken over by another close")
        _settle_parts(session, job, round_, counted)
        if round_.index + 1 < job.federation["rounds"]:
            next_round = {"index": round_.index + 1, "b_sha256": files.b_sha256, "momentum_sha256": next_momentum}
            session.add(Round(job_id=job.id, status="open", **next_round))
        else:
            session.execute(
                update(Job)
                .where(Job.id == job.id, Job.status == "running")
                .values(status="succeeded", progress_step=job.spec["steps"], updated_at=now)
            )
        session.commit()
    except BaseException:  # nothing of the close is written; the caller retries or aborts it
        session.rollback()
        raise


def _settle_parts(session: Session, job: Job, round_: Round, counted: list[int]) -> None:
    """A close's parts: the reports it aggregated (``counted``) say so; leased clients left behind are stragglers,
    expired (a buffered job's only once the next version would find them more than ``max_staleness`` old)."""
    if counted:
        session.execute(update(RoundClient).where(RoundClient.id.in_(counted)).values(counted_in_round_id=round_.id))
    left_behind = RoundClient.round_id == round_.id
    if buffered(job.federation):
        too_old = round_.index - job.federation["max_staleness"]
        left_behind = RoundClient.round_id.in_(select(Round.id).where(Round.job_id == job.id, Round.index <= too_old))
    session.execute(
        update(RoundClient)
        .where(left_behind, RoundClient.status == "leased")
        .values(status="expired", lease_expires_at=None)
    )


def retry_close(session: Session, round_: Round, closing_at: datetime) -> None:
    """closing → open: aggregation stopped on a failure that says nothing about the round (its worker died or
    timed out, the database hiccuped); the sweeper closes it again, as it closes any open round that is full or
    past its deadline."""
    begin_write(session)
    session.execute(update(Round).where(_closing(round_, closing_at)).values(status="open", closing_at=None))
    session.commit()


def reopen_closing_rounds(session: Session) -> int:
    """closing → open for rounds a stopped server left mid-close (at the start of the one server of a data dir:
    nobody else can be closing them) → how many; the sweeper closes them again."""
    begin_write(session)
    moved = session.execute(
        update(Round).where(Round.status == "closing").values(status="open", closing_at=None)
    ).rowcount
    session.commit()
    return moved


def reopen_stale_closes(session: Session, older_than: timedelta) -> int:
    """closing → open for closes that began more than ``older_than`` ago (longer than any close may take: the
    process running it died) → how many. With several API processes this is how a round left mid-close gets
    closed again; should the old closer still be alive, its attempt no longer holds the round."""
    begin_write(session)
    stale = or_(Round.closing_at.is_(None), Round.closing_at < utcnow() - older_than)
    moved = session.execute(
        update(Round).where(Round.status == "closing", stale).values(status="open", closing_at=None)
    ).rowcount
    session.commit()
    return moved


def abort_close(session: Session, round_: Round, closing_at: datetime, error: str) -> None:
    """closing → failed, and the job with it (aggregation could not finish: a missing file, a worker error)."""
    begin_write(session)
    moved = session.execute(
        update(Round).where(_closing(round_, closing_at)).values(status="failed", closed_at=utcnow())
    ).rowcount
    session.commit()
    if moved:
        fail(session, round_.job_id, f"round {round_.index}: {error}", ("running",))


def reopen(session: Session, round_: Round, timeout_s: float) -> bool:
    """At the timeout with fewer than M reports, once: the round stays open for another ``timeout_s``."""
    begin_write(session)
    moved = session.execute(
        update(Round)
        .where(Round.id == round_.id, Round.status == "open", Round.reopened == 0)
        .values(reopened=1, deadline_at=utcnow() + timedelta(seconds=timeout_s))
    ).rowcount
    session.commit()
    return bool(moved)


def fail_round(session: Session, round_: Round, reason: str) -> bool:
    """open → failed at its second timeout with fewer than M reports; the job fails with the reason."""
    begin_write(session)
    moved = session.execute(
        update(Round).where(Round.id == round_.id, Round.status == "open").values(status="failed", closed_at=utcnow())
    ).rowcount
    session.commit()
    if moved:
        fail(session, round_.job_id, f"round {round_.index}: {reason}", ("running",))
    return bool(moved)
