"""Benchmarks share the tests' real S3 server (moto over HTTP) and fault proxy fixtures.

With ``--benchmark-disable`` (the default in pyproject, so the test suite and CI run these modules
once at small sizes and they cannot rot) ``UC_BENCH_QUICK=1`` is set before the modules are imported;
``--benchmark-enable --benchmark-only`` measures at full size."""

import os

from tests.support.s3_fixtures import fault_proxy, s3_bucket, s3_server  # noqa: F401 - pytest fixtures


def pytest_configure(config) -> None:
    if config.getoption("benchmark_disable", False) and not config.getoption("benchmark_enable", False):
        os.environ["UC_BENCH_QUICK"] = "1"
