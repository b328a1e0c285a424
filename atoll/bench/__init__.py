"""Benchmarks (`atoll bench ...`), each printing one JSON object."""
