"""Standing jobs: a job that leases a new session each time an eligible device asks (``jobs.standing``), its
sessions (``jobs.standing_job_id``), its promoted version (``jobs.promoted_adapter_id``) and whether a session's
version was promoted (``adapters.promoted``).

Revision ID: 0016
Revises: 0015

Jobs before are not standing and no session's; their adapters have NULL in ``promoted``.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("standing", sa.Boolean(), nullable=False, server_default=sa.false()))
        batch.add_column(sa.Column("standing_job_id", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("promoted_adapter_id", sa.Integer(), nullable=True))
        batch.create_index("ix_jobs_standing_job_id", ["standing_job_id"])
    with op.batch_alter_table("adapters") as batch:
        batch.add_column(sa.Column("promoted", sa.Boolean(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("adapters") as batch:
        batch.drop_column("promoted")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_index("ix_jobs_standing_job_id")
        batch.drop_column("promoted_adapter_id")
        batch.drop_column("standing_job_id")
        batch.drop_column("standing")
