"""Benchmarks share the tests' real S3 server (moto over HTTP) and fault proxy fixtures."""

from tests.s3_fixtures import fault_proxy, s3_bucket, s3_server  # noqa: F401 - pytest fixtures
