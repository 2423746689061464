"""Devices report their CPU (``devices.cpu_arch``, ``devices.cpu_features``: ``shared.cpuinfo``) at enrollment and
whenever they ask for work.

Revision ID: 0013
Revises: 0012

Devices enrolled before have NULL in both until they next ask for work.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("devices") as batch:
        batch.add_column(sa.Column("cpu_arch", sa.String(16), nullable=True))
        batch.add_column(sa.Column("cpu_features", sa.String(200), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("devices") as batch:
        batch.drop_column("cpu_features")
        batch.drop_column("cpu_arch")
