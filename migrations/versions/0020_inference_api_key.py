"""inference api key: the key a model's endpoint takes, beside its address

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-07

`models.inference_api_key`: the key the backend's endpoint takes for this model, written
with `inference_base_url` by the worker that serves it. The cpu backend's endpoint takes a
key per model (`app.backends.cpu_server.ModelKeys`), so an `agent` rollout's service, told
its model's, reaches no other project's model there; a gateway in a process without a
worker forwards with this one. NULL for the rows from before: the worker writes it when it
serves the model again. A nullable column, on both dialects.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0020"
down_revision: str | None = "0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("models", sa.Column("inference_api_key", sa.String(256), nullable=True))


def downgrade() -> None:
    op.drop_column("models", "inference_api_key")
