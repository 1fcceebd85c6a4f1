"""Set-up of the reliability suite: one CPU thread for torch while these tests run.

The suite trains tiny models through the real trainer and runs training subprocesses side by side. On a small
shared machine several OpenMP threads per process spin against each other (a tiny step measured ~9x slower with two
threads than with one under load), so every test here runs with one thread and the previous setting is restored.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

# tests/scripted.py (scripted policies, the trainer Recorder) is shared with the tests one level up.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """``torch.set_num_threads(1)`` for each module of the suite (module scope: module-scoped training runs get it)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
