"""Alembic environment of the registry DB. The URL comes from the caller (parity.tracking.registry.migrate)
or from alembic.ini / PARITY_REGISTRY_URL when run as `alembic -c platform/parity/tracking/alembic.ini upgrade head`."""

from __future__ import annotations

import os

from alembic import context
from sqlalchemy import create_engine, pool

from parity.tracking.registry.models import Base

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    return config.get_main_option("sqlalchemy.url") or os.environ.get("PARITY_REGISTRY_URL", "sqlite:///outputs/registry.db")


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = create_engine(_url(), poolclass=pool.NullPool)
    with engine.connect() as conn:
        context.configure(connection=conn, target_metadata=target_metadata, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
