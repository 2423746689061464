"""A user's privacy ledger: the budget its private jobs spend from, and the version that serializes submits.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-24

``jobs.private``: the job's spec has ``privacy`` (rows written before are not private). ``privacy_epsilon`` and
``privacy_delta`` null: the server's defaults (``Settings.privacy_budget_epsilon`` and
``shared.defaults.DP_DELTA``).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("private", sa.Boolean(), nullable=False, server_default=sa.false()))
    with op.batch_alter_table("users") as batch:
        batch.add_column(sa.Column("privacy_epsilon", sa.Float(), nullable=True))
        batch.add_column(sa.Column("privacy_delta", sa.Float(), nullable=True))
        batch.add_column(sa.Column("privacy_version", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("users") as batch:
        batch.drop_column("privacy_version")
        batch.drop_column("privacy_delta")
        batch.drop_column("privacy_epsilon")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("private")
