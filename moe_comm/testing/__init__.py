"""Test and benchmark helpers, never imported by the core: the dense float64 reference, self-checking
payloads, routing workloads."""
