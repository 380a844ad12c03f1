"""Registry DB (SQLAlchemy 2 ORM, Alembic migrations): SQLite by default, PostgreSQL by URL."""

from parity.tracking.registry.store import Registry, RegistryError

__all__ = ["Registry", "RegistryError"]
