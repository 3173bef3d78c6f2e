"""Seeded draws from torch's global random generator, which every thread of a process
shares: a draw seeded in one thread while another thread seeds or draws gets the other's
numbers. Whatever draws from a seed it was given does so inside `seeded`."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

_LOCK = threading.Lock()


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Seed torch's generator and hold it until the block's draws are done."""
    import torch

    with _LOCK:
        torch.manual_seed(seed)
        yield
