#!/usr/bin/env bash
# The body of `make lint`: ruff on the Python trees, hadolint on both Dockerfiles, and the compose
# files validated by Debian's docker-compose (no Docker engine needed for `config`).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${VENV:-.venv}"
status=0

step() { echo "== $*"; }

step "ruff"
dirs=()
for d in platform tasks flows dashboards tests; do [[ -d "$d" ]] && dirs+=("$d"); done
"$venv/bin/ruff" check "${dirs[@]}" || status=1

step "hadolint docker/Dockerfile docker/Dockerfile.gpu"
"$venv/bin/hadolint" docker/Dockerfile docker/Dockerfile.gpu || status=1

step "docker-compose config"
if ! command -v docker-compose >/dev/null 2>&1; then
  # CI machines start bare. --no-install-recommends: the package otherwise pulls in a Docker engine.
  sudo=""
  [[ "$(id -u)" -eq 0 ]] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends docker-compose >/dev/null
fi
# The secrets have no defaults on purpose (compose refuses to start without them); lint supplies
# placeholders so that everything else is checked.
lint_env=(POSTGRES_PASSWORD=lint-placeholder RAY_AUTH_TOKEN=lint-placeholder)
env "${lint_env[@]}" docker-compose --env-file docker/.env.example -f docker/compose.yaml config -q || status=1
env "${lint_env[@]}" docker-compose --env-file docker/.env.example \
  -f docker/compose.yaml -f docker/compose.gpu.yaml config -q || status=1

[[ $status -eq 0 ]] && echo "lint: ok" || echo "lint: FAILED" >&2
exit $status
