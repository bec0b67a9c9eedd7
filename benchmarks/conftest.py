"""Benchmarks share the tests' real S3 server (moto over HTTP) and fault proxy fixtures, and need the
``bench`` extra (``UC_SETUP_EXTRAS=test,bench ./scripts/test.sh benchmarks``).

With ``--benchmark-disable`` (the default in pyproject, so a run of these modules does each once at
small sizes and they cannot rot) ``UC_BENCH_QUICK=1`` is set before the modules are imported;
``--benchmark-enable --benchmark-only`` measures at full size."""

import importlib.util
import os

import pytest

from tests.support.s3_fixtures import fault_proxy, s3_bucket, s3_server  # noqa: F401 - pytest fixtures


def pytest_configure(config) -> None:
    if importlib.util.find_spec("psutil") is None:
        raise pytest.UsageError(
            "the benchmarks need the bench extra (psutil and the peers they compare with): "
            "UC_SETUP_EXTRAS=test,bench ./scripts/test.sh benchmarks"
        )
    if config.getoption("benchmark_disable", False) and not config.getoption("benchmark_enable", False):
        os.environ["UC_BENCH_QUICK"] = "1"
