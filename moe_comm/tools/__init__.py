"""Tooling on top of the library, never imported by the core: CLI, bench, diagnose, launch, slow_link."""
