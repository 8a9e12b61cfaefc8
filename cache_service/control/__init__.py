"""The control plane's pure logic: block pools, block tables, the prefix index, placement,
accounting, snapshots and the integrity check.

Imports nothing of the rest of cache_service but `cache_service.errors`, and no torch, Ray,
gRPC or numpy (tests/test_import_rules.py), so it runs in property tests in milliseconds.
"""
