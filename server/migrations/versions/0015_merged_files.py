"""Merged downloads kept by content, bounded per user and in total (``merged_files``, ``server.merged_builds``).

Revision ID: 0015
Revises: 0014

Merges kept before (``merged/<sha256>.zip`` found through ``merged/<archive>-<dtype>.json``) have no row: the server
removes them at start (``MergedBuilds.remove_unrecorded``) and builds again on request.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "merged_files",
        sa.Column("key", sa.String(64), primary_key=True),
        sa.Column("user_id", sa.Integer(), sa.ForeignKey("users.id"), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("used_at", sa.DateTime(), nullable=False),
    )
    op.create_index("ix_merged_files_user_id", "merged_files", ["user_id"])
    op.create_index("ix_merged_files_used_at", "merged_files", ["used_at"])


def downgrade() -> None:
    op.drop_index("ix_merged_files_used_at", table_name="merged_files")
    op.drop_index("ix_merged_files_user_id", table_name="merged_files")
    op.drop_table("merged_files")
