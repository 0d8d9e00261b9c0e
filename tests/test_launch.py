"""moe_comm.launch: the freed-memory cache of spawned ranks (checked by counting page faults)."""
import subprocess
import sys

import pytest

_PROBE = r"""
import resource, sys, torch
from moe_comm.launch import cache_freed_memory, freed_memory_cached
assert not freed_memory_cached()
if sys.argv[1] == "cache":
    assert cache_freed_memory() and freed_memory_cached()
n = 64 << 20
torch.empty(n, dtype=torch.uint8).fill_(1)  # first use of 64 MiB: faults either way
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
torch.empty(n, dtype=torch.uint8).fill_(1)  # freed and allocated again
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    r = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return int(r.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_cache_freed_memory_stops_page_faults_on_reuse():
    plain, cached = _faults("plain"), _faults("cache")
    # 64 MiB of 4 KiB pages is 16384 faults when glibc unmaps and maps again; reused heap memory: ~none.
    assert plain > 4000, plain
    assert cached < plain / 20, (cached, plain)
