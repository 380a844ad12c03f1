"""Read-only access to what the dashboard shows: the MLflow tracking store, the registry database and the
report files under outputs/. Nothing here writes: SQLite stores are opened with `mode=ro` URIs (a missing
file is reported, never created), other databases are only SELECTed from with bound parameters, and the
MLflow client only searches runs and reads metric histories.

Every failure a user can cause (no store yet, a server that does not answer, a malformed report) raises
`SourceUnavailable` with a message meant for the page; the pages show it with st.info/st.warning."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pandas as pd

from parity.tracking.secrets import mask_url

# An unreachable MLflow server must not hang the page for MLflow's default ~2 minutes of retries.
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")

DEFAULT_MLFLOW_UI = "http://127.0.0.1:5000"


class SourceUnavailable(Exception):
    """A store or report that cannot be read; the message is shown on the page, with any password or token
    of a URL in it masked."""

    def __init__(self, message: str) -> None:
        super().__init__(mask_url(str(message)))


@dataclass(frozen=True)
class Sources:
    tracking_uri: str
    registry_url: str
    outputs_dir: str
    mlflow_ui: str = DEFAULT_MLFLOW_UI


def load_sources() -> Sources:
    """Where to read from: parity's config (cfg.tracking.*, cfg.outputs_dir), which honours PARITY_TRACKING_URI,
    PARITY_REGISTRY_URL and PARITY_OUTPUTS. PARITY_MLFLOW_UI is the MLflow UI the run links point at when the
    tracking URI is not itself a server."""
    from parity.config import load_config

    cfg = load_config([], validate=False)
    uri = str(cfg.tracking.tracking_uri)
    ui = uri if uri.startswith(("http://", "https://")) else os.environ.get("PARITY_MLFLOW_UI", DEFAULT_MLFLOW_UI)
    return Sources(uri, str(cfg.tracking.registry_url), str(cfg.outputs_dir), public_url(ui).rstrip("/"))


def public_url(url: str) -> str:
    """A URL the page may show or link to: credentials (user:password@) and secret query values removed."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.hostname and "@" in parts.netloc:
        host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
        parts = parts._replace(netloc=host + (f":{parts.port}" if parts.port else ""))
    return mask_url(urlunsplit(parts))


# ---------------------------------------------------------------- read-only connections

def sqlite_path(url: str) -> Path | None:
    """The file of a sqlite URL (sqlite:///rel or sqlite:////abs), None for other databases."""
    if not url.startswith("sqlite"):
        return None
    rest = url.split(":///", 1)[1] if ":///" in url else ""
    rest = rest.split("?", 1)[0]
    if not rest or rest == ":memory:":
        raise SourceUnavailable(f"{url!r} is an in-memory database: there is nothing to read")
    return Path(rest.removeprefix("file:"))


def readonly_url(url: str, what: str) -> str:
    """SQLite becomes a read-only URI (`mode=ro`, so no file or table is ever created); the `sqlite+pysqlite`
    spelling also keeps MLflow from creating parent folders. A missing file raises SourceUnavailable."""
    path = sqlite_path(url)
    if path is None:
        return url
    if not path.is_file():
        raise SourceUnavailable(f"No {what} yet: {path} does not exist. Run a pipeline first "
                                f"(or point the dashboard at another store).")
    return f"sqlite+pysqlite:///file:{quote(str(path.resolve()))}?mode=ro&uri=true"


def _probe_server(uri: str, timeout_s: float = 3.0) -> None:
    try:
        # /health needs no credentials (and urllib cannot take them from the URL)
        with urllib.request.urlopen(f"{public_url(uri).rstrip('/')}/health", timeout=timeout_s) as r:  # noqa: S310 (configured URL)
            r.read(64)
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise SourceUnavailable(f"MLflow server at {uri} is unreachable ({e}). Start it (`make mlflow-ui`) or "
                                "set PARITY_TRACKING_URI.") from e


def mlflow_client(tracking_uri: str) -> Any:
    """An MlflowClient on the tracking store, read-only for SQLite; SourceUnavailable when there is none."""
    if tracking_uri.startswith(("http://", "https://")):
        _probe_server(tracking_uri)  # before importing mlflow: a dead server is reported in milliseconds
    from mlflow import MlflowClient

    if tracking_uri.startswith(("http://", "https://")):
        return MlflowClient(tracking_uri)
    if tracking_uri.startswith("sqlite"):
        return MlflowClient(readonly_url(tracking_uri, "MLflow store"))
    path = Path(tracking_uri.removeprefix("file://"))
    if not path.is_dir():
        raise SourceUnavailable(f"No MLflow store yet: {path} does not exist.")
    return MlflowClient(tracking_uri)


# ---------------------------------------------------------------- MLflow runs

@dataclass
class RunRecord:
    run_id: str
    run_name: str
    experiment_id: str
    experiment: str
    status: str
    start_time: int | None
    params: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)  # latest value of each key
    tags: dict[str, str] = field(default_factory=dict)
    end_time: int | None = None
    metric_steps: dict[str, int] = field(default_factory=dict)  # the step of each key's latest value

    @property
    def parent_id(self) -> str | None:
        return self.tags.get("mlflow.parentRunId")


def fetch_runs(client: Any, max_results: int = 5000) -> list[RunRecord]:
    """Every active run of every experiment (one search call)."""
    from mlflow.exceptions import MlflowException

    try:
        exps = {e.experiment_id: e.name for e in client.search_experiments()}
        if not exps:
            return []
        runs = client.search_runs(list(exps), max_results=max_results, order_by=["attributes.start_time DESC"])
    except MlflowException as e:
        raise SourceUnavailable(f"The MLflow store could not be read: {e.message}") from e
    except Exception as e:  # sqlalchemy/requests errors surface as various types; the page needs a message
        raise SourceUnavailable(f"The MLflow store could not be read: {type(e).__name__}: {e}") from e
    return [RunRecord(r.info.run_id, r.info.run_name or r.info.run_id[:8], r.info.experiment_id,
                      exps.get(r.info.experiment_id, r.info.experiment_id), r.info.status, r.info.start_time,
                      dict(r.data.params), dict(r.data.metrics), dict(r.data.tags), r.info.end_time,
                      _latest_steps(r.data)) for r in runs]


def _latest_steps(run_data: Any) -> dict[str, int]:
    """The step of each metric's latest value (the client keeps the Metric objects beside the value dict)."""
    out: dict[str, int] = {}
    for m in getattr(run_data, "_metric_objs", None) or []:
        out[m.key] = int(m.step)
    return out


def metric_history(client: Any, run_ids: list[str], keys: list[str]) -> pd.DataFrame:
    """Long table (run_id, key, step, value) of the given runs and metric keys; a run without a key
    contributes no rows (the page says which are missing)."""
    rows: list[tuple[str, str, int, float, int]] = []
    for rid in run_ids:
        for key in keys:
            try:
                hist = client.get_metric_history(rid, key)
            except Exception as e:
                raise SourceUnavailable(f"Metric history of run {rid} ({key}) could not be read: {e}") from e
            rows.extend((rid, key, int(m.step), float(m.value), int(m.timestamp)) for m in hist)
    cols = ["run_id", "key", "step", "value"]
    df = pd.DataFrame(rows, columns=[*cols, "timestamp"]).sort_values(["run_id", "key", "step", "timestamp"],
                                                                      kind="stable")
    # MLflow keeps every logged value; a resumed run can log a step twice, the last write wins
    return df.drop_duplicates(["run_id", "key", "step"], keep="last")[cols].reset_index(drop=True)


def mlflow_run_url(ui: str, experiment_id: str, run_id: str) -> str:
    from parity.tracking.naming import run_url

    return run_url(ui, experiment_id, run_id)


# ---------------------------------------------------------------- registry database

def registry_engine(url: str) -> Any:
    import sqlalchemy as sa

    return sa.create_engine(readonly_url(url, "registry database"))


def registry_tables(engine: Any) -> dict[str, Any]:
    """Reflected tables of the registry (name -> sqlalchemy Table); {} for an empty database."""
    import sqlalchemy as sa

    md = sa.MetaData()
    try:
        md.reflect(bind=engine)
    except sa.exc.SQLAlchemyError as e:
        raise SourceUnavailable(f"The registry database could not be read: {e}") from e
    return dict(md.tables)


# ---------------------------------------------------------------- report files under outputs/

def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SourceUnavailable(f"{path}: not a readable JSON report ({e})") from e
    if not isinstance(data, dict):
        raise SourceUnavailable(f"{path}: a report must be a JSON object, found {type(data).__name__}")
    return data


def eval_summaries(outputs_dir: str) -> tuple[list[tuple[Path, dict]], list[str]]:
    """(path, metrics.json) of every `evaluate` output under <outputs>/eval/*/, oldest first, and one
    message per file that could not be read (shown, not fatal)."""
    found, problems = [], []
    for p in sorted(Path(outputs_dir, "eval").glob("*/metrics.json"), key=lambda p: p.stat().st_mtime):
        try:
            found.append((p, read_json(p)))
        except SourceUnavailable as e:
            problems.append(str(e))
    return found, problems


def precision_reports(outputs_dir: str) -> tuple[list[tuple[Path, dict]], list[str]]:
    """(path, report) of every validation report under <outputs>/precision_validation/<checkpoint>/, oldest
    first, and one message per report file that could not be read. Only report files are opened: the kept
    reports under validations/ (`python -m parity validate` writes one per validation), or, in a folder from
    before they were kept, its validation.json. The quantized checkpoint beside them (config.json,
    tokenizer files, precision.json, ...) is never read."""
    from parity.precision.reports import HISTORY_DIR, LATEST_STEM, is_report

    found, problems = [], []
    for folder in sorted(p for p in Path(outputs_dir, "precision_validation").glob("*") if p.is_dir()):
        hist = folder / HISTORY_DIR
        paths = sorted(hist.glob("*.json")) if hist.is_dir() else [folder / f"{LATEST_STEM}.json"]
        for p in paths:
            if not p.is_file():
                continue
            try:
                rep = read_json(p)
            except SourceUnavailable as e:
                problems.append(str(e))
                continue
            if not is_report(rep):
                problems.append(f"{p}: not a validation report (no `metrics` and `passed`): skipped")
                continue
            found.append((p, rep))
    found.sort(key=lambda pr: (str(pr[1].get("created_at") or ""), str(pr[0])))
    return found, problems


def run_configs(outputs_dir: str) -> dict[str, dict[str, str]]:
    """{run name: flattened params} from <outputs>/runs/*/config.yaml (the resolved config the loop saved), so
    file-based evaluations of a run can be labelled with its correction even without MLflow."""
    from omegaconf import OmegaConf

    out: dict[str, dict[str, str]] = {}
    for p in sorted(Path(outputs_dir, "runs").glob("*/config.yaml")):
        try:
            cfg = OmegaConf.to_container(OmegaConf.load(p), resolve=False)
        except Exception:  # a half-written or foreign file only loses its label, never the page
            continue
        flat: dict[str, str] = {}

        def walk(node: object, prefix: str, flat: dict[str, str] = flat) -> None:
            if isinstance(node, dict):
                for k, v in node.items():
                    walk(v, f"{prefix}.{k}" if prefix else str(k))
            else:
                flat[prefix] = str(node)

        walk(cfg, "")
        out[p.parent.name] = flat
    return out


def _registry_select(url: str, needed: tuple[str, ...], build: Any) -> pd.DataFrame | None:
    """Run the SELECT `build(tables)` on the registry; None when it lacks one of the `needed` tables (a
    registry that was never migrated, or another schema)."""
    import sqlalchemy as sa

    engine = registry_engine(url)
    try:
        tables = registry_tables(engine)
        if any(t not in tables for t in needed):
            return None
        try:
            with engine.connect() as conn:
                res = conn.execute(build(tables))
                return pd.DataFrame(res.fetchall(), columns=list(res.keys()))
        except (sa.exc.SQLAlchemyError, KeyError, AttributeError) as e:
            raise SourceUnavailable(f"The registry at {url} could not be read (schema changed?): {e}") from e
    finally:
        engine.dispose()


def _col(table: Any, name: str) -> Any:
    """A column of a reflected table, or NULL under its name when the registry predates it (never migrated:
    the dashboard does not write)."""
    import sqlalchemy as sa

    return table.c[name] if name in table.c else sa.null()


def registry_evaluations(url: str, limit: int = 20_000) -> pd.DataFrame | None:
    """evaluation_results with the precision each ran in, the evaluated artifact (its precision, path, what it
    was trained as: `facts`, its registered version) and the pipeline's MLflow run."""
    import sqlalchemy as sa

    def build(t: dict[str, Any]) -> Any:
        r, a, p = t["evaluation_results"], t["model_artifacts"], t["pipelines"]
        return (sa.select(r.c.id, r.c.benchmark, r.c.k, r.c.problems, r.c.metrics, r.c.out_dir, r.c.created_at,
                          r.c.pipeline_id, a.c.precision, a.c.path.label("artifact_path"),
                          _col(r, "precision").label("eval_precision"), _col(a, "facts").label("facts"),
                          a.c.mlflow_model_version, a.c.pipeline_id.label("artifact_pipeline_id"),
                          p.c.experiment, p.c.mlflow_run_id, p.c.overrides)
                .select_from(r.outerjoin(a, r.c.artifact_id == a.c.id).outerjoin(p, r.c.pipeline_id == p.c.id))
                .order_by(r.c.id).limit(sa.bindparam("limit", limit)))

    return _registry_select(url, ("evaluation_results", "model_artifacts", "pipelines"), build)


def registry_checks(url: str, limit: int = 20_000) -> pd.DataFrame | None:
    """regression_checks, oldest first, with both sides: the evaluation's precision, the evaluated artifact's
    facts (what it was trained as) and registered version, for the candidate and the baseline (champion)."""
    import sqlalchemy as sa

    def build(t: dict[str, Any]) -> Any:
        c, r, a, p = t["regression_checks"], t["evaluation_results"], t["model_artifacts"], t["pipelines"]
        rb, ab = r.alias("rb"), a.alias("ab")
        return (sa.select(c.c.id, c.c.created_at, c.c.benchmark, c.c.delta, c.c.ci_low, c.c.ci_high, c.c.margin,
                          c.c.paired_problems, c.c.passed, c.c.message, c.c.baseline_result_id,
                          c.c.candidate_result_id, c.c.pipeline_id, p.c.flow_run_id, a.c.precision,
                          a.c.path.label("candidate_path"), _col(r, "precision").label("candidate_eval_precision"),
                          _col(a, "facts").label("candidate_facts"),
                          a.c.mlflow_model_version.label("candidate_version"),
                          _col(rb, "precision").label("baseline_eval_precision"),
                          ab.c.precision.label("baseline_precision"), _col(ab, "facts").label("baseline_facts"),
                          ab.c.mlflow_model_version.label("baseline_version"))
                .select_from(c.outerjoin(p, c.c.pipeline_id == p.c.id)
                             .outerjoin(r, c.c.candidate_result_id == r.c.id)
                             .outerjoin(a, r.c.artifact_id == a.c.id)
                             .outerjoin(rb, c.c.baseline_result_id == rb.c.id)
                             .outerjoin(ab, rb.c.artifact_id == ab.c.id))
                .order_by(c.c.created_at, c.c.id).limit(sa.bindparam("limit", limit)))

    return _registry_select(url, ("regression_checks", "evaluation_results", "model_artifacts", "pipelines"), build)
