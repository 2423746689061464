"""Programs of both kinds in one table (``programs.kind``: training or inference), so that every file a device
downloads is found by content (``GET /v1/blobs/{sha256}``), an inference program's included.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-24

Rows written before are training programs.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("programs") as batch:
        batch.add_column(sa.Column("kind", sa.String(16), nullable=False, server_default="training"))


def downgrade() -> None:
    with op.batch_alter_table("programs") as batch:
        batch.drop_column("kind")
