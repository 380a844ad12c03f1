#!/usr/bin/env bash
# Runs once, when the postgres container starts on an empty data volume (docker-entrypoint-initdb.d):
# one server, one database per consumer, all owned by POSTGRES_USER (an existing one is kept). Names come from the same
# variables that compose.yaml puts into each service's URL, so they cannot disagree.
set -euo pipefail

for var in POSTGRES_USER MLFLOW_DB PREFECT_DB REGISTRY_DB; do
  name="${!var:-}"
  # identifiers are interpolated into SQL below: accept only plain names
  if [[ ! "$name" =~ ^[a-z_][a-z0-9_]{0,62}$ ]]; then
    echo "init-databases: $var='$name' is not a plain lower-case SQL name" >&2
    exit 1
  fi
  [[ "$var" == POSTGRES_USER ]] && continue
  echo "init-databases: creating database $name"
  psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname "${POSTGRES_DB:-$POSTGRES_USER}" <<SQL
SELECT format('CREATE DATABASE %I OWNER %I', '$name', '$POSTGRES_USER')
WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = '$name')\\gexec
SQL
done
