"""Stopping background tasks without swallowing the caller's own cancellation."""

from __future__ import annotations

import asyncio
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
