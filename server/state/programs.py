"""Compiled programs' rows and the merged downloads kept on disk (``server.state``'s transaction rule): a training
program's row is written with its job's ``ready`` (``server.state.jobs.finish_compiling``), an inference program's
on its own; merged downloads are counted against their user and evicted least recently used first.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    delete,
    select,
    update,
)
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from server.db import begin_write
from server.tables import (
    MergedFile,
    Program,
    utcnow,
)
from shared.manifest import ProgramManifest


def program_row(session: Session, model_id: int, key: str, manifest: dict[str, Any], kind: str = "training") -> Program:
    """The Program row of ``key`` (a training or an inference program), inserted on first sight; flushed (the caller
    commits)."""
    begin_write(session)
    existing = session.scalar(select(Program).where(Program.key == key))
    if existing is not None:
        return existing
    memory_mb = ProgramManifest.model_validate(manifest).memory_mb if kind == "training" else None
    program = Program(
        key=key,
        kind=kind,
        model_id=model_id,
        manifest=manifest,
        memory_mb=memory_mb,
    )
    try:
        with session.begin_nested():
            session.add(program)
    except IntegrityError:  # another job (or process) with the same config got there first
        return session.scalars(select(Program).where(Program.key == key)).one()
    return program


def add_inference_program(session: Session, model_id: int, key: str, manifest: dict[str, Any]) -> None:
    """A built inference program's row (``program_row``), committed: its files are granted to devices."""
    program_row(session, model_id, key, manifest, kind="inference")
    session.commit()


def keep_merged(
    session: Session, key: str, user_id: int, built: dict[str, Any], per_user_bytes: int, total_bytes: int
) -> list[str]:
    """A built merged download's row (``built``: its sha256 and size), counted against ``user_id``, and the rows
    evicted to keep the bounds: least recently used first, the user's own until they hold at most
    ``per_user_bytes``, then anyone's until all hold at most ``total_bytes``; never the new one → the evicted keys,
    whose files the caller removes once this is committed (``server.merged_builds``)."""
    begin_write(session)
    now = utcnow()
    row = session.get(MergedFile, key)
    if row is None:
        session.add(MergedFile(key=key, user_id=user_id, sha256=built["sha256"], size=built["size"], used_at=now))
    else:
        row.user_id, row.sha256, row.size, row.used_at = user_id, built["sha256"], built["size"], now
    session.flush()
    kept = session.execute(
        select(MergedFile.key, MergedFile.user_id, MergedFile.size)
        .order_by(MergedFile.used_at, MergedFile.key)
        .with_for_update()
    ).all()
    evicted: list[str] = []
    for whose, bound in ((user_id, per_user_bytes), (None, total_bytes)):
        held = [r for r in kept if r.key not in evicted and (whose is None or r.user_id == whose)]
        used = sum(r.size for r in held)
        for r in held:
            if used <= bound:
                break
            if r.key != key:
                evicted.append(r.key)
                used -= r.size
    if evicted:
        session.execute(delete(MergedFile).where(MergedFile.key.in_(evicted)))
    session.commit()
    return evicted


def touch_merged(session: Session, key: str) -> None:
    """A merged download served: it is now the most recently used."""
    begin_write(session)
    session.execute(update(MergedFile).where(MergedFile.key == key).values(used_at=utcnow()))
    session.commit()


def forget_merged(session: Session, keys: list[str]) -> None:
    """Merged downloads whose files are gone (removed by hand, or a data dir restored without them)."""
    begin_write(session)
    session.execute(delete(MergedFile).where(MergedFile.key.in_(keys)))
    session.commit()
