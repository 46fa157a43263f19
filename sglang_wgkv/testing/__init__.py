"""The harness shared by tests and benchmarks."""
