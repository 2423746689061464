"""Adapters keep what personalization did on the device's held-out data (``held_out``: before/after accuracy and
loss, ``shared.schemas.HeldOut``), so the registry and ``mobizo jobs show`` can show it without reading metrics.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22

Rows written before have no held-out figures: NULL.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("adapters") as batch:
        batch.add_column(sa.Column("held_out", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("adapters") as batch:
        batch.drop_column("held_out")
