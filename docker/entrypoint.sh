#!/usr/bin/env bash
# One image, several services: the first argument names the role (see docker/README.md); anything
# else is run as given, so `docker run IMAGE python -m parity train ...` works too.
# Every role `exec`s its server so signals from `docker stop` reach it directly.
set -euo pipefail

role="${1:-help}"
[[ $# -gt 0 ]] && shift

# The healthcheck (docker/healthcheck.py) runs as a separate process and cannot see this
# script's arguments: leave the role where it can read it.
printf '%s\n' "$role" > "${PARITY_ROLE_FILE:-/tmp/parity-role}" 2>/dev/null || true

require() {  # name a missing setting instead of letting a server fail later with a vague error
  local name
  for name in "$@"; do
    if [[ -z "${!name:-}" ]]; then
      echo "entrypoint: role '$role' needs the environment variable $name (see docker/.env.example)" >&2
      exit 64
    fi
  done
}

# ray start takes resources only as flags; unset = let Ray detect them
ray_resources=()
[[ -z "${RAY_NUM_CPUS:-}" ]] || ray_resources+=("--num-cpus=${RAY_NUM_CPUS}")
[[ -z "${RAY_NUM_GPUS:-}" ]] || ray_resources+=("--num-gpus=${RAY_NUM_GPUS}")
[[ -z "${RAY_OBJECT_STORE_BYTES:-}" ]] || ray_resources+=("--object-store-memory=${RAY_OBJECT_STORE_BYTES}")

case "$role" in
  ray-head)
    exec ray start --head --block --port="${RAY_GCS_PORT:-6379}" \
      --dashboard-host=0.0.0.0 --dashboard-port="${RAY_DASHBOARD_PORT:-8265}" \
      --ray-client-server-port="${RAY_CLIENT_PORT:-10001}" "${ray_resources[@]}" "$@"
    ;;
  ray-worker)
    require RAY_HEAD_ADDRESS
    exec ray start --block --address="${RAY_HEAD_ADDRESS}" "${ray_resources[@]}" "$@"
    ;;
  flows)
    # A Ray driver must run on a Ray node: with PARITY_RAY_ADDRESS=auto this container joins the
    # cluster as a node without resources, so actors are placed on the workers, not here.
    if [[ -n "${RAY_HEAD_ADDRESS:-}" && "${PARITY_RAY_ADDRESS:-}" == "auto" ]]; then
      ray start --address="${RAY_HEAD_ADDRESS}" --num-cpus=0 --num-gpus=0
    fi
    require PREFECT_API_URL
    exec python -m flows.deployments "$@"
    ;;
  dashboard)
    exec streamlit run dashboards/app.py --server.address=0.0.0.0 \
      --server.port="${DASHBOARD_PORT:-8501}" --server.headless=true \
      --browser.gatherUsageStats=false "$@"
    ;;
  mlflow)
    require MLFLOW_BACKEND_STORE_URI
    exec mlflow server --host 0.0.0.0 --port "${MLFLOW_PORT:-5000}" --workers "${MLFLOW_WORKERS:-1}" \
      --backend-store-uri "${MLFLOW_BACKEND_STORE_URI}" \
      --artifacts-destination "${MLFLOW_ARTIFACTS_DESTINATION:-/data/mlflow-artifacts}" --serve-artifacts "$@"
    ;;
  prefect-server)
    require PREFECT_API_DATABASE_CONNECTION_URL
    exec prefect server start --host 0.0.0.0 --port "${PREFECT_SERVER_PORT:-4200}" "$@"
    ;;
  parity)
    exec python -m parity "$@"
    ;;
  help|--help|-h)
    echo "roles: ray-head ray-worker flows dashboard mlflow prefect-server parity <command> | any command"
    ;;
  *)
    exec "$role" "$@"
    ;;
esac
