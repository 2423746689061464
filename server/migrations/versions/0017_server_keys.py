"""The server's own secrets (``server_keys``), made at random by the first API process that needs one
(``server.accounts.server_key``) and shared by every process through the database: ``sign_in``, the key the
dashboard's sign-in form tokens are the HMAC of their cookie under (``server.dashboard.web``), so that a sign-in
cookie a browser was given by another site matches no form token.

Revision ID: 0017
Revises: 0016
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "server_keys",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("value", sa.String(128), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("server_keys")
