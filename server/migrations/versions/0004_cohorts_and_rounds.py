"""Cohorts, consent and federated rounds; cohort-owned adapters.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-22

A federated job belongs to a cohort, not a user (``jobs.user_id`` nullable, ``jobs.cohort_id``, its round settings
in ``jobs.federation``); its rounds and each device's part in a round get their own tables. A cohort's adapter
versions are owned by the cohort (``adapters.cohort_id``; ``user_id`` and ``job_id`` None, lineage through
``round_id``), counted per cohort.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "cohorts",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("model_id", sa.Integer(), nullable=False),
        sa.Column("task", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(["model_id"], ["models.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("name"),
    )
    op.create_table(
        "cohort_members",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("cohort_id", sa.Integer(), nullable=False),
        sa.Column("user_id", sa.Integer(), nullable=False),
        sa.Column("joined_at", sa.DateTime(), nullable=False),
        sa.Column("left_at", sa.DateTime(), nullable=True),
        sa.ForeignKeyConstraint(["cohort_id"], ["cohorts.id"]),
        sa.ForeignKeyConstraint(["user_id"], ["users.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("cohort_id", "user_id"),
    )
    with op.batch_alter_table("cohort_members") as batch:
        batch.create_index(batch.f("ix_cohort_members_cohort_id"), ["cohort_id"], unique=False)
        batch.create_index(batch.f("ix_cohort_members_user_id"), ["user_id"], unique=False)
    with op.batch_alter_table("jobs") as batch:
        batch.alter_column("user_id", existing_type=sa.Integer(), nullable=True)
        batch.add_column(sa.Column("cohort_id", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("federation", sa.JSON(), nullable=True))
        batch.create_foreign_key("fk_jobs_cohort_id", "cohorts", ["cohort_id"], ["id"])
        batch.create_index(batch.f("ix_jobs_cohort_id"), ["cohort_id"], unique=False)
    op.create_table(
        "rounds",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("index", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("b_sha256", sa.String(length=64), nullable=False),
        sa.Column("deadline_at", sa.DateTime(), nullable=True),
        sa.Column("reopened", sa.Integer(), nullable=False),
        sa.Column("adapter_id", sa.Integer(), nullable=True),
        sa.Column("mean_loss", sa.Float(), nullable=True),
        sa.Column("aggregate_s", sa.Float(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("closed_at", sa.DateTime(), nullable=True),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("job_id", "index"),
    )
    with op.batch_alter_table("rounds") as batch:
        batch.create_index(batch.f("ix_rounds_job_id"), ["job_id"], unique=False)
    op.create_table(
        "round_clients",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("round_id", sa.Integer(), nullable=False),
        sa.Column("user_id", sa.Integer(), nullable=False),
        sa.Column("device_id", sa.Integer(), nullable=False),
        sa.Column("device_backend", sa.String(length=16), nullable=False),
        sa.Column("seed", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("lease_expires_at", sa.DateTime(), nullable=True),
        sa.Column("progress_step", sa.Integer(), nullable=True),
        sa.Column("log_sha256", sa.String(length=64), nullable=True),
        sa.Column("b_sha256", sa.String(length=64), nullable=True),
        sa.Column("mean_loss", sa.Float(), nullable=True),
        sa.Column("replay_s", sa.Float(), nullable=True),
        sa.Column("log_bytes", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("reported_at", sa.DateTime(), nullable=True),
        sa.ForeignKeyConstraint(["device_id"], ["devices.id"]),
        sa.ForeignKeyConstraint(["round_id"], ["rounds.id"]),
        sa.ForeignKeyConstraint(["user_id"], ["users.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("round_id", "user_id"),
    )
    with op.batch_alter_table("round_clients") as batch:
        batch.create_index(batch.f("ix_round_clients_round_id"), ["round_id"], unique=False)
    with op.batch_alter_table("adapters") as batch:
        batch.alter_column("user_id", existing_type=sa.Integer(), nullable=True)
        batch.alter_column("job_id", existing_type=sa.Integer(), nullable=True)
        batch.add_column(sa.Column("cohort_id", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("round_id", sa.Integer(), nullable=True))
        batch.create_foreign_key("fk_adapters_cohort_id", "cohorts", ["cohort_id"], ["id"])
        batch.create_foreign_key("fk_adapters_round_id", "rounds", ["round_id"], ["id"])
        batch.create_unique_constraint("uq_adapters_cohort_version", ["cohort_id", "version"])
        batch.create_index(batch.f("ix_adapters_cohort_id"), ["cohort_id"], unique=False)


def downgrade() -> None:
    op.execute("DELETE FROM adapters WHERE cohort_id IS NOT NULL")
    with op.batch_alter_table("adapters") as batch:
        batch.drop_index(batch.f("ix_adapters_cohort_id"))
        batch.drop_constraint("uq_adapters_cohort_version", type_="unique")
        batch.drop_constraint("fk_adapters_round_id", type_="foreignkey")
        batch.drop_constraint("fk_adapters_cohort_id", type_="foreignkey")
        batch.drop_column("round_id")
        batch.drop_column("cohort_id")
        batch.alter_column("job_id", existing_type=sa.Integer(), nullable=False)
        batch.alter_column("user_id", existing_type=sa.Integer(), nullable=False)
    op.drop_table("round_clients")
    op.drop_table("rounds")
    op.execute("DELETE FROM jobs WHERE cohort_id IS NOT NULL")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_index(batch.f("ix_jobs_cohort_id"))
        batch.drop_constraint("fk_jobs_cohort_id", type_="foreignkey")
        batch.drop_column("federation")
        batch.drop_column("cohort_id")
        batch.alter_column("user_id", existing_type=sa.Integer(), nullable=False)
    op.drop_table("cohort_members")
    op.drop_table("cohorts")
