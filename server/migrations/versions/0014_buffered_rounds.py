"""Buffered federated rounds: a round part's report may be aggregated by a later round than the one it leased
(``round_clients.counted_in_round_id``, the round whose close counted it).

Revision ID: 0014
Revises: 0013

Parts reported before stay NULL: they were counted by their own round's close, if it closed.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("round_clients") as batch:
        batch.add_column(sa.Column("counted_in_round_id", sa.Integer(), nullable=True))
        batch.create_foreign_key("fk_round_clients_counted_in", "rounds", ["counted_in_round_id"], ["id"])
        batch.create_index("ix_round_clients_counted_in_round_id", ["counted_in_round_id"])


def downgrade() -> None:
    with op.batch_alter_table("round_clients") as batch:
        batch.drop_index("ix_round_clients_counted_in_round_id")
        batch.drop_constraint("fk_round_clients_counted_in", type_="foreignkey")
        batch.drop_column("counted_in_round_id")
