"""Task and cleanup helpers: stopping a background task without swallowing the caller's own
cancellation (``stop_task``), and undoing a step when the block after it fails (``OnFailure``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import TracebackType
from typing import Any

RECANCEL_S = 1.0
"""How long ``stop_task`` waits before cancelling a task again that has not ended."""


async def stop_task(task: asyncio.Task[Any]) -> None:
    """Cancel ``task`` and wait until it has ended; raise what it raised other than its
    cancellation. The caller's own cancellation (a shutdown's deadline, say) interrupts the wait
    and propagates: ``await task`` in ``suppress(CancelledError)`` would instead hand it to the
    task, swallow it when the task ends, and wait as long as a task slow to stop takes. A task
    still running ``RECANCEL_S`` after a cancel is cancelled again: a cancel can be lost (in
    Python 3.11 ``asyncio.wait_for``, which redis-py uses, drops one that meets the answer it
    waits for), and a loop that lost it would run on for good."""
    task.cancel()
    while not (await asyncio.wait({task}, timeout=RECANCEL_S))[0]:
        task.cancel()
    if not task.cancelled():
        task.result()


class OnFailure:
    """``with OnFailure(undo):`` calls ``undo()`` when the block raises (a cancellation
    included), and nothing when it completes: what a claim, a reservation or an open answer needs
    until someone else takes it over. (``contextlib.ExitStack`` with ``pop_all`` does the same at
    three times the cost, on every request.)"""

    __slots__ = ("_undo",)

    def __init__(self, undo: Callable[[], object]) -> None:
        self._undo = undo

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if kind is not None:
            self._undo()
