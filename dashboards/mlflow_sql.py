"""Fast read path for MLflow stores kept in a SQL database (the SQLite default, PostgreSQL in production):
plain SELECTs on MLflow's own tables instead of the client's ORM, which builds one Python object per
param, tag and metric (search_runs of 50 runs x 150 params took ~1-2 s here, most of a page load).

Same results as the client path (a test compares both on a real store): active runs of active
experiments, params, tags, the latest value of each metric, and full metric histories. Read-only like
the rest: the engine comes from data.readonly_url (SQLite `mode=ro`). Stores behind an MLflow server
(http[s]://) or a file store go through the client (data.fetch_runs / data.metric_history)."""

from __future__ import annotations

import functools
import math
from typing import Any

import pandas as pd

from dashboards.data import RunRecord, SourceUnavailable, readonly_url

SQL_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")
TABLES = ("experiments", "runs", "params", "tags", "latest_metrics", "metrics")


def is_sql_store(tracking_uri: str) -> bool:
    return tracking_uri.split(":", 1)[0].split("+", 1)[0] in SQL_SCHEMES


def engine(tracking_uri: str) -> Any:
    import sqlalchemy as sa

    return sa.create_engine(readonly_url(tracking_uri, "MLflow store"))


@functools.lru_cache(maxsize=8)  # reflection is a third of a query's time; the engine lives as long as the app
def _tables(eng: Any) -> dict[str, Any]:
    import sqlalchemy as sa

    md = sa.MetaData()
    try:
        md.reflect(bind=eng, only=list(TABLES))
    except sa.exc.InvalidRequestError as e:  # a table is missing: not (yet) an MLflow store
        raise SourceUnavailable(f"{eng.url.render_as_string(hide_password=True)} is not an MLflow store: {e}") from e
    except sa.exc.SQLAlchemyError as e:
        raise SourceUnavailable(f"The MLflow store could not be read: {e}") from e
    return dict(md.tables)


def _value(value: float, is_nan: Any) -> float:
    return math.nan if is_nan else float(value)


def fetch_runs(eng: Any) -> list[RunRecord]:
    """Every active run of every active experiment, newest first."""
    import sqlalchemy as sa

    t = _tables(eng)
    e, r = t["experiments"], t["runs"]
    try:
        with eng.connect() as c:
            exps = {str(i): n for i, n in c.execute(sa.select(e.c.experiment_id, e.c.name)
                                                    .where(e.c.lifecycle_stage == "active"))}
            runs = c.execute(sa.select(r.c.run_uuid, r.c.name, r.c.experiment_id, r.c.status, r.c.start_time,
                                       r.c.end_time)
                             .where(r.c.lifecycle_stage == "active").order_by(r.c.start_time.desc())).all()
            recs = {rid: RunRecord(rid, name or rid[:8], str(eid), exps[str(eid)], status, start, end_time=end)
                    for rid, name, eid, status, start, end in runs if str(eid) in exps}
            for rid, k, v in c.execute(sa.select(t["params"].c.run_uuid, t["params"].c.key, t["params"].c.value)):
                if rid in recs:
                    recs[rid].params[k] = v
            for rid, k, v in c.execute(sa.select(t["tags"].c.run_uuid, t["tags"].c.key, t["tags"].c.value)):
                if rid in recs:
                    recs[rid].tags[k] = v
            lm = t["latest_metrics"]
            for rid, k, v, nan, step in c.execute(sa.select(lm.c.run_uuid, lm.c.key, lm.c.value, lm.c.is_nan,
                                                            lm.c.step)):
                if rid in recs:
                    recs[rid].metrics[k] = _value(v, nan)
                    recs[rid].metric_steps[k] = int(step)
    except sa.exc.SQLAlchemyError as err:
        raise SourceUnavailable(f"The MLflow store could not be read: {err}") from err
    return list(recs.values())


def metric_history(eng: Any, run_ids: list[str], keys: list[str]) -> pd.DataFrame:
    """Long table (run_id, key, step, value) like data.metric_history: one SELECT with bound IN lists; a
    step logged twice keeps its last write (by timestamp)."""
    import sqlalchemy as sa

    m = _tables(eng)["metrics"]
    cols = ["run_id", "key", "step", "value"]
    if not run_ids or not keys:
        return pd.DataFrame(columns=cols)
    q = (sa.select(m.c.run_uuid, m.c.key, m.c.step, m.c.value, m.c.is_nan, m.c.timestamp)
         .where(m.c.run_uuid.in_(sa.bindparam("ids", expanding=True)), m.c.key.in_(sa.bindparam("keys", expanding=True))))
    try:
        with eng.connect() as c:
            rows = c.execute(q, {"ids": list(run_ids), "keys": list(keys)}).all()
    except sa.exc.SQLAlchemyError as err:
        raise SourceUnavailable(f"Metric histories could not be read: {err}") from err
    df = pd.DataFrame([(rid, k, int(s), _value(v, nan), ts) for rid, k, s, v, nan, ts in rows],
                      columns=[*cols, "timestamp"])
    df = df.sort_values(["run_id", "key", "step", "timestamp"], kind="stable")
    return df.drop_duplicates(["run_id", "key", "step"], keep="last")[cols].reset_index(drop=True)
