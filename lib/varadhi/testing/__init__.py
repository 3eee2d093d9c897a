"""Helpers for tests, the demo and benchmarks: real local servers, no mocks.

`varadhi.testing.endpoint.TestEndpoint` is a recording HTTP endpoint on loopback. Import it from
its module: this package imports nothing itself, so `python -m varadhi.testing.endpoint` runs
without runpy's double-import warning.
"""
