"""Test and benchmark helpers, never imported by the core: the dense float64 reference, self-checking
payloads, routing workloads, HostSyncs (what would make the host wait for a GPU, recorded on any device)
nccl_rules (NCCL's rules enforced on gloo runs) and faults (fault injection for the fault suite)."""
