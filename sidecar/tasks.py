"""Task and cleanup helpers: stopping a background task without swallowing the caller's own
cancellation (``stop_task``), and undoing a step when the block after it fails (``OnFailure``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import TracebackType
from typing import Any


async def stop_task(task: asyncio.Task[Any]) -> None:
    """Cancel ``task`` and wait until it has ended; raise what it raised other than its
    cancellation. The caller's own cancellation (a shutdown's deadline, say) interrupts the wait
    and propagates: ``await task`` in ``suppress(CancelledError)`` would instead hand it to the
    task, swallow it when the task ends, and wait as long as a task slow to stop takes."""
    task.cancel()
    await asyncio.wait({task})
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
