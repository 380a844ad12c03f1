"""A registered model (`eval.registered_model=NAME[:VERSION]`) to the checkpoint folder to load.

The train-and-eval flow's `register` stage writes each trained checkpoint twice: as a version of the
MLflow registered model `tracking.model_name` (a copy of the folder as the run's `model` artifact), and
as the registry DB row of the checkpoint artifact (its folder under outputs/runs, with lineage) carrying
that MLflow name and version. The registry DB is asked first (the checkpoint folder, the artifact id
and lineage); when it does not know the model or the version, or the checkpoint folder has since been
deleted (checkpoint rotation, a cleaned outputs/), the MLflow model version's own copy is used.

Nothing is created on the way: a SQLite registry or MLflow store that does not exist is skipped, not
made empty."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from parity.core.secrets import mask_url
from parity.errors import ParityError

KEY = "eval.registered_model"


def parse_spec(spec: str, key: str = KEY) -> tuple[str, int | None]:
    """'name' or 'name:latest' -> (name, None); 'name:3' -> (name, 3)."""
    s = str(spec).strip()
    name, sep, version = s.rpartition(":")
    if not sep:
        name, version = s, ""
    if not name:
        raise ParityError(f"config key `{key}`: {spec!r} has no model name (expected NAME or NAME:VERSION)")
    if version in ("", "latest"):
        return name, None
    if not version.isdigit() or int(version) < 1:
        raise ParityError(f"config key `{key}`: version {version!r} of {spec!r} must be a positive integer or "
                          "'latest' (NAME or NAME:VERSION)")
    return name, int(version)


def _sqlite_file(url: str) -> Path | None:
    """The database file of a sqlite URL (None for other backends or in-memory)."""
    for prefix in ("sqlite:///", "sqlite+pysqlite:///"):
        if url.startswith(prefix):
            rest = url.removeprefix(prefix).split("?", 1)[0]
            return None if rest in ("", ":memory:") else Path(rest)
    return None


def _is_model_dir(p: Path | None) -> bool:
    return p is not None and (p / "config.json").is_file()


def _registry_versions(registry_url: str, name: str) -> tuple[list[dict], list[str], str | None]:
    """(rows of `name` oldest first, all registered names, why the DB was not consulted)."""
    f = _sqlite_file(registry_url)
    if f is not None and not f.is_file():
        return [], [], f"no registry database at {f}"
    from parity.tracking.registry import Registry, RegistryError

    try:
        with Registry(registry_url) as reg:
            return reg.registered_versions(name), reg.registered_names(), None
    except RegistryError as e:
        return [], [], str(e)


def _mlflow_client(tracking_uri: str) -> tuple[Any, str | None]:
    f = _sqlite_file(tracking_uri)
    if f is not None and not f.is_file():
        return None, f"no MLflow store at {f}"
    from parity.tracking import mlflow_log

    if not mlflow_log.reachable(tracking_uri):
        return None, f"MLflow store {mask_url(tracking_uri)} not reachable"
    return mlflow_log.client(tracking_uri), None


def _mlflow_versions(c: Any, name: str) -> list[Any]:
    quoted = f'"{name}"' if "'" in name else f"'{name}'"
    try:
        found = c.search_model_versions(filter_string=f"name={quoted}")
    except Exception:  # an unknown name or a store without a model registry
        return []
    return sorted(found, key=lambda mv: int(mv.version))


def _local_copy(c: Any, tracking_uri: str, source: str, dest: Path) -> Path | None:
    """The folder of an MLflow model version's source: itself when it is on this filesystem, else
    downloaded once under `dest`."""
    u = urlparse(source)
    if u.scheme in ("", "file"):
        p = Path(unquote(u.path)) if u.scheme else Path(source)
        return p if _is_model_dir(p) else None
    if _is_model_dir(dest):
        return dest
    try:
        import mlflow.artifacts

        dest.mkdir(parents=True, exist_ok=True)
        got = Path(mlflow.artifacts.download_artifacts(artifact_uri=source, dst_path=str(dest),
                                                       tracking_uri=tracking_uri))
    except Exception:
        return None
    for cand in (got, got / "model"):
        if _is_model_dir(cand):
            return cand
    return None


def resolve_registered_model(spec: str, registry_url: str, tracking_uri: str, download_dir: str | Path,
                             key: str = KEY) -> dict:
    """{'name', 'version', 'path', 'source', 'artifact_id', 'precision', 'validation_status', ...} of the
    registered model `spec` (NAME, NAME:latest or NAME:VERSION); one ParityError naming `key` when the
    name or version is unknown or no folder of it is left.

    The registry DB answers when it knows the name (latest = its newest version) and the folder is there;
    MLflow (imported only then, it takes seconds) is asked for a name or version the DB does not know,
    and for its copy of a version whose checkpoint folder is gone."""
    name, want = parse_spec(spec, key)
    rows, names, db_note = _registry_versions(registry_url, name)
    db_versions = sorted({int(r["mlflow_model_version"]) for r in rows})
    out: dict[str, Any] = {"name": name, "version": None, "spec": str(spec), "artifact_id": None,
                           "precision": None, "validation_status": None, "pipeline_id": None,
                           "checkpoint": None, "mlflow_source": None}
    if db_versions and (want is None or want in db_versions):
        version = db_versions[-1] if want is None else want
        row = next(r for r in reversed(rows) if int(r["mlflow_model_version"]) == version)
        out.update(version=version, artifact_id=row["id"], precision=row["precision"],
                   validation_status=row["validation_status"], pipeline_id=row["pipeline_id"], checkpoint=row["path"])
        if _is_model_dir(Path(row["path"])):
            return {**out, "path": row["path"], "source": "registry database"}

    c, mlflow_note = _mlflow_client(tracking_uri)
    mvs = _mlflow_versions(c, name) if c is not None else []
    if not rows and not mvs:
        where = (f"the registry database {mask_url(registry_url)}" + (f" ({db_note})" if db_note else "")
                 + f" or the MLflow model registry {mask_url(tracking_uri)}"
                 + (f" ({mlflow_note})" if mlflow_note else ""))
        known = set(names)
        if c is not None:
            try:
                known |= {m.name for m in c.search_registered_models()}
            except Exception:
                pass
        raise ParityError(f"config key `{key}`: no registered model named {name!r} in {where}"
                          + (f"; registered: {', '.join(sorted(known))}" if known else "; nothing is registered yet"))
    versions = sorted(set(db_versions) | {int(m.version) for m in mvs})
    version = out["version"] or (versions[-1] if want is None else want)
    if version not in versions:
        raise ParityError(f"config key `{key}`: model {name!r} has no version {version}; versions: "
                          + ", ".join(map(str, versions)))
    mv = next((m for m in mvs if int(m.version) == version), None)
    out["version"] = version
    if mv is not None:
        tags = dict(getattr(mv, "tags", None) or {})
        out.update(mlflow_source=mv.source, precision=out["precision"] or tags.get("precision"),
                   validation_status=out["validation_status"] or tags.get("validation_status"))
    tried = []
    if out["checkpoint"] is not None:
        tried.append(f"checkpoint folder {out['checkpoint']} (registry database)")
    if mv is not None and mv.source:
        p = _local_copy(c, tracking_uri, str(mv.source), Path(download_dir) / f"{name}-v{version}")
        if p is not None:
            return {**out, "path": str(p), "source": "MLflow model registry"}
        tried.append(f"MLflow copy {mask_url(str(mv.source))}")
    raise ParityError(f"config key `{key}`: model {name!r} version {version} is registered but no model folder "
                      "(config.json) is left: " + "; ".join(tried or ["no location recorded"]))
