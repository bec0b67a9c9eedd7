"""Test support: the HTTP fault proxy and S3 fixtures, caching file systems, the crash loop."""
