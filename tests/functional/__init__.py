"""Functional tests: real S3 over HTTP (a local moto server, the HTTP fault proxy), the CLI, docs, mounts."""
