"""An admin's dashboard session remembers the admin token it was opened with (``web_sessions.admin_token_hash``),
so that it ends when the token is rotated or unset (``server.dashboard.web.current_viewer``).

Revision ID: 0012
Revises: 0011

Admin sessions opened before have NULL there and are refused at their next page: the admin signs in again.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("web_sessions") as batch:
        batch.add_column(sa.Column("admin_token_hash", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("web_sessions") as batch:
        batch.drop_column("admin_token_hash")
