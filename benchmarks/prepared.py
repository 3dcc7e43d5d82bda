"""What a peer's preparation gives the bench, and how it declines a workload: shared by
`benchmarks.backends` (the in-process peers) and `benchmarks.vllm085` (a peer in a worker
process), which both import it (never each other's module in a circle)."""

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np


class Skip(Exception):
    """This peer does not run this workload here (the message says why)."""


@dataclasses.dataclass
class Prepared:
    call: Callable[[], Any]  # one step; returns once the result is ready
    output: Callable[[Any], np.ndarray]  # a call's result as float32 [T, Hq, D]
    info: dict = dataclasses.field(default_factory=dict)
    # One call returning its own duration, for a peer whose calls are timed where they run
    # (another process); None: the bench times `call` itself.
    timed: Callable[[], float] | None = None
    close: Callable[[], None] | None = None  # after the workload's rounds (frees its memory)
