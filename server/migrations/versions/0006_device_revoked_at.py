"""Devices can be revoked (``devices.revoked_at``): a lost or sold phone's token is refused from then on, by every
API process, and its leases are released.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-24

Rows written before are live devices: NULL.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("devices") as batch:
        batch.add_column(sa.Column("revoked_at", sa.DateTime(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("devices") as batch:
        batch.drop_column("revoked_at")
