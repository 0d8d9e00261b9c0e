"""moe_comm.tools.launch: the freed-memory cache of spawned ranks (checked by counting page faults)."""
import subprocess
import sys

import pytest

_PROBE = r"""
import resource, sys, torch
from moe_comm.tools.launch import cache_freed_memory, freed_memory_cached
assert not freed_memory_cached()
if sys.argv[1] == "cache":
    assert cache_freed_memory() and freed_memory_cached()
n = 64 << 20
for _ in range(3):  # first uses: fault either way, and the heap settles into reusable free blocks
    torch.empty(n, dtype=torch.uint8).fill_(1)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):  # freed and allocated again
    torch.empty(n, dtype=torch.uint8).fill_(1)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    r = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return int(r.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_cache_freed_memory_stops_page_faults_on_reuse():
    plain, cached = _faults("plain"), _faults("cache")
    # 4 x 64 MiB of 4 KiB pages is 65536 faults when glibc unmaps and maps again; reused heap memory: ~none.
    # (A single reuse right after the first allocation can still land on fresh heap pages: warm up first.)
    assert plain > 16000, plain
    assert cached < plain / 20, (cached, plain)
