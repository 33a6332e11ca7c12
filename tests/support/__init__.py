"""Test support: real local servers and helpers shared by tests and benchmarks."""
