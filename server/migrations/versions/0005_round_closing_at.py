"""Rounds record when their current close began (``rounds.closing_at``): with several API processes no start-up can
tell a close left by a dead process from one a live process is running, but a close older than the longest a
close may take is dead, and the stamp also names the attempt, so that a closer that was given up on cannot publish
after another took the round over.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-22

Rows written before have no stamp: NULL (a round left ``closing`` then counts as stale).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("rounds") as batch:
        batch.add_column(sa.Column("closing_at", sa.DateTime(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("rounds") as batch:
        batch.drop_column("closing_at")
