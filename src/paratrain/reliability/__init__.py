"""Failure handling: health checks and peer loss, signals, stuck collectives, injected
faults for tests, and wait notices."""
