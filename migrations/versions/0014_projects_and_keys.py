"""projects and keys: projects, API keys stored as SHA-256 hashes, the audit log

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-05

`projects` (a `default` project, `proj_default`, is written here), `api_keys` (only the
hex SHA-256 of each secret; its prefix for display), `audit_events` (every request that
changed something). `project_id` on models, datasets, jobs, runs and webhook endpoints: NOT
NULL, with the default project as its server default, which fills the rows already there
on both dialects (a plain added column: SQLite adds a NOT NULL column with a default).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import app.db

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

DEFAULT_PROJECT_ID = "proj_default"  # app.models.DEFAULT_PROJECT_ID, as it was written here
OWNED = ("models", "datasets", "jobs", "runs", "webhook_endpoints")


def upgrade() -> None:
    projects = op.create_table(
        "projects",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("created_at", app.db.UTCDateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_projects")),
        sa.UniqueConstraint("name", name=op.f("uq_projects_name")),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("project_id", sa.String(length=40), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("scopes", app.db.JSONType, nullable=False),
        sa.Column("secret_sha256", sa.String(length=64), nullable=False),
        sa.Column("prefix", sa.String(length=16), nullable=False),
        sa.Column("expires_at", app.db.UTCDateTime(timezone=True), nullable=True),
        sa.Column("revoked_at", app.db.UTCDateTime(timezone=True), nullable=True),
        sa.Column("last_used_at", app.db.UTCDateTime(timezone=True), nullable=True),
        sa.Column("created_at", app.db.UTCDateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["project_id"],
            ["projects.id"],
            name=op.f("fk_api_keys_project_id_projects"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
        sa.UniqueConstraint("secret_sha256", name=op.f("uq_api_keys_secret_sha256")),
    )
    op.create_index(op.f("ix_api_keys_project_id"), "api_keys", ["project_id"])
    op.create_table(
        "audit_events",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("at", app.db.UTCDateTime(timezone=True), nullable=False),
        sa.Column("key_id", sa.String(length=40), nullable=True),
        sa.Column("project_id", sa.String(length=40), nullable=True),
        sa.Column("method", sa.String(length=8), nullable=False),
        sa.Column("route", sa.String(length=256), nullable=False),
        sa.Column("resource_id", sa.String(length=256), nullable=True),
        sa.Column("status", sa.Integer(), nullable=False),
        sa.Column("request_id", sa.String(length=128), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_events")),
    )
    op.create_index(op.f("ix_audit_events_at"), "audit_events", ["at"])
    op.bulk_insert(
        projects,
        [{"id": DEFAULT_PROJECT_ID, "name": "default", "created_at": app.db.utcnow()}],
    )
    for table in OWNED:
        op.add_column(
            table,
            sa.Column(
                "project_id",
                sa.String(length=40),
                nullable=False,
                server_default=DEFAULT_PROJECT_ID,
            ),
        )


def downgrade() -> None:
    for table in reversed(OWNED):
        with op.batch_alter_table(table) as batch_op:
            batch_op.drop_column("project_id")
    op.drop_index(op.f("ix_audit_events_at"), table_name="audit_events")
    op.drop_table("audit_events")
    op.drop_index(op.f("ix_api_keys_project_id"), table_name="api_keys")
    op.drop_table("api_keys")
    op.drop_table("projects")
