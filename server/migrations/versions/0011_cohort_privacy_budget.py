"""A cohort's privacy budget: what its private federated jobs may spend of each member's data (``server.privacy``).

Revision ID: 0011
Revises: 0010
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("cohorts") as batch:
        batch.add_column(sa.Column("privacy_epsilon", sa.Float(), nullable=True))
        batch.add_column(sa.Column("privacy_delta", sa.Float(), nullable=True))
        batch.add_column(sa.Column("privacy_version", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("cohorts") as batch:
        batch.drop_column("privacy_version")
        batch.drop_column("privacy_delta")
        batch.drop_column("privacy_epsilon")
