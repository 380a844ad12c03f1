"""Shared fixtures: a session-wide outputs folder and a quickly prepared tiny model, and the compute dtype the
numerical tests check.

`model.dtype=auto` computes in bfloat16 on CPUs with native bf16 (AVX512-BF16, AMX) and in float32 on
AVX2-only ones, so a test that left it on auto would check a different dtype on different machines. The quick
settings pin it instead: float32, or what PARITY_TEST_DTYPE says (float32 | bfloat16). `make test` runs the
dtype-sensitive files a second time with PARITY_TEST_DTYPE=bfloat16, whatever the CPU.

Tests that leave model.dtype on auto (flows, commands, presets run as a user runs them) assert what holds in both
dtypes. PARITY_AUTO_DTYPE=bfloat16 (read by the library, parity.rollout.compute_dtype) makes auto resolve to
bfloat16 on any CPU, so an AVX2 machine runs the suite an AVX512-BF16 one runs; the report header says what auto
resolves to."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
REPO = Path(__file__).resolve().parents[1]
DATASETS = Path(os.environ.get("PARITY_DATASETS", REPO.parent / "shared" / "datasets"))
os.environ.setdefault("PARITY_DATASETS", str(DATASETS))

TEST_DTYPE = os.environ.get("PARITY_TEST_DTYPE", "float32")
if TEST_DTYPE not in ("float32", "bfloat16"):
    raise ValueError(f"PARITY_TEST_DTYPE must be float32 or bfloat16, got {TEST_DTYPE!r}")

# Settings of a run that takes seconds: small warm start, few prompts, short responses, the pinned dtype.
QUICK = [f"model.dtype={TEST_DTYPE}",
    "model.warm_start.steps=30", "model.warm_start.eval_problems=16", "trainer.eval_problems=16",
    "trainer.prompts_per_step=2", "rollout.n=4", "rollout.max_new_tokens=12", "trainer.total_steps=2",
    "trainer.checkpoint_every=1", "trainer.eval_every=0", "eval.grade_workers=1",
]


from tests.prefect_services import prefect_services, sweep_regression, sweep_store  # noqa: E402,F401  (session fixtures)
from tests.quantized_outputs import quantized_outputs  # noqa: E402,F401  (session fixture)


@pytest.fixture(scope="session")
def test_dtype():
    """The torch dtype the quick settings compute in (model.dtype, see the module docstring)."""
    import torch

    return getattr(torch, TEST_DTYPE)


def _dtypes_line() -> str:

    import torch

    from parity.rollout import compute_dtype

    auto = str(compute_dtype("auto", torch.device("cpu")))
    how = "PARITY_AUTO_DTYPE" if os.environ.get("PARITY_AUTO_DTYPE") else "this CPU"
    return (f"parity: numerical tests check model.dtype={TEST_DTYPE} (PARITY_TEST_DTYPE); "
            f"model.dtype=auto resolves to {auto.removeprefix('torch.')} ({how})")


def pytest_report_header(config: pytest.Config) -> str:
    return _dtypes_line()


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    terminalreporter.write_line(_dtypes_line())  # with -q too, where the header is not printed


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread in this process for a module (`pytestmark = pytest.mark.usefixtures(...)`): Ray gives each
    1-CPU actor one OpenMP thread, and in-process results compared bit for bit with the actors' must use as many
    (the reduction order depends on it)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def outputs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("outputs")


@pytest.fixture(scope="session")
def quick_cfg(outputs_dir: Path):
    """Compose a config with the quick settings, writing under the session's outputs folder."""
    from parity.config import load_config

    def make(*overrides: str):
        return load_config([f"outputs_dir={outputs_dir}", *QUICK, *overrides])

    return make


@pytest.fixture(scope="session")
def prepared_model(quick_cfg) -> Path:
    """The warm-started tiny model, warm-started in float32 whatever TEST_DTYPE is: its weights are test input,
    and bf16 is emulated on AVX2 CPUs (minutes). Its folder does not depend on the dtype, so runs of any dtype
    that prepare the same settings find it."""
    from parity.training.warm_start import prepare_model

    return Path(prepare_model(quick_cfg("model.dtype=float32"))["model_dir"])


# Files whose tests import Flask into this process (an in-process MLflow server app). vLLM's CPU start-up
# scans every loaded module's attributes, and Flask's LocalProxy objects raise on that scan, so the vLLM
# tests run after everything else except these; vLLM in turn changes process-wide torch state, so the
# tests compared bit for bit against Ray actors run before it.
_FLASK_IMPORTERS = {"test_tracking_mlflow.py", "test_dashboard_pages.py", "test_dashboard_sweep.py", "test_docker_compose.py",
                    "test_reliability_faults.py", "test_reliability_security.py"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return 2 if name in _FLASK_IMPORTERS else 1 if name.startswith("test_vllm") else 0

    items.sort(key=rank)


@pytest.fixture(scope="module")
def mlflow_store(tmp_path_factory) -> str:
    """One MLflow SQLite store for one test module's tests (a new store runs MLflow's migrations: seconds)."""
    from parity.tracking import mlflow_log

    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow-store')}/mlflow.db"
    mlflow_log.experiment_id(mlflow_log.client(uri), "reliability", mlflow_log.default_artifact_dir(uri))
    return uri
