#!/usr/bin/env bash
# Runs once, when the postgres container starts on an empty data volume (docker-entrypoint-initdb.d):
# one server, one database per consumer, all owned by POSTGRES_USER (an existing one is kept). Names
# come from the same variables that compose.yaml puts into each service's URL, so they cannot disagree.
set -euo pipefail

# Every name is checked before anything is created: a bad one must not leave a half-made server
# (this script never runs again on a non-empty volume). Plain names only, since they go into SQL.
for var in POSTGRES_USER MLFLOW_DB PREFECT_DB REGISTRY_DB; do
  if [[ ! "${!var:-}" =~ ^[a-z_][a-z0-9_]{0,62}$ ]]; then
    echo "init-databases: $var='${!var:-}' is not a plain lower-case SQL name" >&2
    exit 1
  fi
done

for var in MLFLOW_DB PREFECT_DB REGISTRY_DB; do
  name="${!var}"
  echo "init-databases: creating database $name"
  psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname "${POSTGRES_DB:-$POSTGRES_USER}" <<SQL
SELECT format('CREATE DATABASE %I OWNER %I', '$name', '$POSTGRES_USER')
WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = '$name')\\gexec
SQL
done
