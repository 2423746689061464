"""Adapters remember the sha256 of the B the device uploaded (``upload_b_sha256``) beside the stored one.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22

The server stores the B it replays from the log, which for a device running eager torch may differ from the
uploaded B by a few ulps; a repeated upload is recognised by the uploaded bytes. Rows written before stored the
uploaded B itself, so their upload hash is their B hash.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("adapters") as batch:
        batch.add_column(sa.Column("upload_b_sha256", sa.String(length=64), nullable=True))
    op.execute("UPDATE adapters SET upload_b_sha256 = b_sha256")
    with op.batch_alter_table("adapters") as batch:
        batch.alter_column("upload_b_sha256", existing_type=sa.String(length=64), nullable=False)


def downgrade() -> None:
    with op.batch_alter_table("adapters") as batch:
        batch.drop_column("upload_b_sha256")
