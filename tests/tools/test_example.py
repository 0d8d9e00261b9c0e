"""Tier 2: multi-rank on CPU. Runs ``examples/train_ep_moe.py`` end to end as a smoke test.

Two spawned gloo ranks train a tiny MoE stack for 40 steps; the script must exit 0, keep the
replicated parameters identical on both ranks, and print a final held-out loss below the first.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "train_ep_moe.py")
FINAL_RE = re.compile(r"^final: held-out loss first ([0-9.]+) -> last ([0-9.]+)", re.MULTILINE)
STEP0_RE = re.compile(r"^step\s+0\s+eval loss ([0-9.]+)", re.MULTILINE)


@pytest.mark.multirank
def test_train_example_loss_falls(tmp_path):
    ckpt = tmp_path / "ckpt.pt"
    cmd = [sys.executable, SCRIPT, "--world-size", "2", "--steps", "40", "--layers", "1", "--hidden", "32",
           "--experts", "4", "--top-k", "2", "--batch", "64", "--log-every", "10", "--timeout", "60",
           "--save", str(ckpt)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit code {proc.returncode}:\n{out[-4000:]}"
    final = FINAL_RE.search(proc.stdout)
    step0 = STEP0_RE.search(proc.stdout)
    assert final and step0, f"missing the step-0 or final loss line:\n{out[-4000:]}"
    first, last = float(final.group(1)), float(final.group(2))
    assert first == pytest.approx(float(step0.group(1)))
    assert last < first, f"loss did not fall: first {first} -> last {last}"
    assert "max difference between ranks 0\n" in proc.stdout, proc.stdout
    assert ckpt.is_file()
