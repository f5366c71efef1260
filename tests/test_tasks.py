"""sidecar.tasks.stop_task: the task's cancellation is dropped, the caller's is not, and a
cancel the task lost is made again."""

from __future__ import annotations

import asyncio

import pytest

from sidecar.tasks import OnFailure, stop_task


@pytest.mark.asyncio
async def test_a_task_is_cancelled_and_waited_for() -> None:
    started = asyncio.Event()

    async def forever() -> None:
        started.set()
        await asyncio.Event().wait()

    task = asyncio.create_task(forever())
    await started.wait()
    await stop_task(task)
    assert task.cancelled()


@pytest.mark.asyncio
async def test_the_callers_own_cancellation_is_not_swallowed() -> None:
    """A task that will not stop, and a caller cancelled while it waits for it (a shutdown's
    deadline): the caller ends cancelled instead of going on waiting."""
    waiting, release = asyncio.Event(), asyncio.Event()

    async def stubborn() -> None:
        while True:
            try:
                waiting.set()
                await release.wait()
                return
            except asyncio.CancelledError:
                continue  # refuses to stop

    task = asyncio.create_task(stubborn())
    await waiting.wait()
    waiting.clear()
    stopper = asyncio.create_task(stop_task(task))
    await waiting.wait()  # cancelled by stop_task, it refused and waits again
    stopper.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stopper
    release.set()
    await task


async def test_a_task_that_lost_its_cancel_is_cancelled_again(monkeypatch) -> None:
    """A loop whose cancel was lost (swallowed once, as Python 3.11's ``asyncio.wait_for``
    does when it meets the answer it waits for) still stops."""
    monkeypatch.setattr("sidecar.tasks.RECANCEL_S", 0.01)
    turns = asyncio.Event()
    lost = 0

    async def loop() -> None:
        nonlocal lost
        while True:
            try:
                turns.set()
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                if lost:
                    raise
                lost += 1  # the first cancel lost: the loop goes on

    task = asyncio.create_task(loop())
    await turns.wait()
    async with asyncio.timeout(5):
        await stop_task(task)
    assert task.cancelled()
    assert lost == 1


async def test_on_failure_undoes_only_when_the_block_fails() -> None:
    undone: list[str] = []
    with OnFailure(lambda: undone.append("completed")):
        pass
    with (
        pytest.raises(ValueError, match="a step failed"),
        OnFailure(lambda: undone.append("raised")),
    ):
        raise ValueError("a step failed")
    with pytest.raises(asyncio.CancelledError), OnFailure(lambda: undone.append("cancelled")):
        raise asyncio.CancelledError
    assert undone == ["raised", "cancelled"]
