"""What becomes of a request's engine work when its client leaves: decided here, for every
connector.

A client that closes its connection cancels its request's task at once (aiohttp's handler
cancellation; a drain that cuts a request cancels it the same way). The parts the cancellation
unwinds through meet it as follows:

- **a prefill call its connector was waiting for** (serial legs: NIXL, shared storage) —
  ``OnDisconnect.prefill_left``, by ``SIDECAR_PREFILL_ON_DISCONNECT``: ``abort`` cancels the call
  (the engine drops a prefill it is still computing); ``finish`` hands it to the background, and
  its KV is released when it arrives; ``auto`` finishes a call predicted to end within
  ``AUTO_FINISH_WITHIN_S`` and aborts one that is queued or far from done (the scheduler predicts:
  ``Scheduler.prefill_outlook``), and aborts every call when releases are off (finishing would
  stage KV that nobody releases). Whatever the mode, a call whose answer has started to arrive is
  finished: the engine is done, its KV staged — unless the background is full, when it is
  aborted and its release counted ``skipped``.
- **any other call still running when its attempt exits** (legs sent at once: SGLang) —
  ``OnDisconnect.abort``: cancelled, held until it ends, counted;
- **KV staged and not taken** — released by its ``StagedKv``'s exit, as after any other failure;
- **the decode leg or the answer** — closed by whoever holds it (the connector's exit, the
  handler's ``finally``); the handler records the request ``cancelled``.

``pd_sidecar_prefill_disconnects_total{action}`` counts what was done with a prefill call still
running. The call's own task reports to the scheduler when it really ends, so an endpoint's slot
is never counted free while the engine still works on it. Nothing here awaits: a second
cancellation (a drain after the client left) cannot skip a step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

from sidecar.connectors.background import BackgroundWork
from sidecar.observability.metrics import Metrics
from sidecar.scheduling.placement import Placement
from sidecar.scheduling.scheduler import Scheduler

AUTO_FINISH_WITHIN_S = 0.5
"""``auto``: a prefill whose client left is let finish when its prompt's own compute, or its
predicted remaining time (overdue included), is within this many seconds; one queued or further
from done is aborted."""

Call = asyncio.Task[Any]


class Running(Protocol):
    """A prefill attempt whose call runs (``sidecar.connectors.prefill.Attempt``)."""

    @property
    def placement(self) -> Placement: ...

    @property
    def started(self) -> float:
        """Loop time the call was sent at."""
        ...

    @property
    def answering(self) -> asyncio.Event:
        """Set once the engine's status line is in."""
        ...

    def hand_over(self, call: Call) -> bool:
        """Let ``call`` end in the background; False when it could not be adopted."""
        ...

    def close(self, *, left: bool = False) -> None:
        """Abort the call unless it ended or was handed over (``left``: counted)."""
        ...


class OnDisconnect:
    """The client-disconnect policy (``SIDECAR_PREFILL_ON_DISCONNECT``: ``auto``, ``abort`` or
    ``finish``), shared by every request: the module's docstring."""

    __slots__ = ("_background", "_metrics", "_mode", "_scheduler")

    def __init__(
        self, mode: str, *, scheduler: Scheduler, background: BackgroundWork, metrics: Metrics
    ) -> None:
        self._mode = mode
        self._scheduler = scheduler
        self._background = background
        self._metrics = metrics

    def prefill_left(
        self, attempt: Running, call: Call, delivered: Callable[[Call], None], *, stages_kv: bool
    ) -> None:
        """The client left while its connector waited for ``attempt``'s ``call``: finish it in
        the background (``delivered`` is called with it once it ends) or abort it.
        ``stages_kv``: a finished call's KV would be released. Synchronous on purpose."""
        if call.done():  # its answer came in with the cancellation
            delivered(call)
            return
        # An engine whose status line is in has finished the prefill (and staged its KV):
        # aborting saves nothing then, and only reading the answer can free the KV.
        answering = attempt.answering.is_set()
        action = "finish" if answering else self._action(attempt.placement, attempt.started)
        if action == "finish" and attempt.hand_over(call):
            call.add_done_callback(delivered)
            self._metrics.prefill_disconnects.labels("finish").inc()
            return
        if answering and stages_kv:
            # Not adopted (the background is full), its staged KV cannot be read now: left to
            # the engine's expiry.
            self._metrics.kv_releases.labels("skipped").inc()
        attempt.close(left=True)

    def abort(self, call: Call, *, left: bool) -> None:
        """Cancel a running prefill ``call``, held until it ends; counted when its client left
        (``left``), not when its own request gave up on it."""
        self._background.abort(call)
        if left:
            self._metrics.prefill_disconnects.labels("abort").inc()

    def _action(self, placement: Placement, started: float) -> str:
        mode = self._mode
        if mode != "auto":
            return mode
        if not self._background.releasing:
            return "abort"  # finishing would only stage KV that nobody releases
        elapsed = asyncio.get_running_loop().time() - started
        outlook = self._scheduler.prefill_outlook(placement, elapsed)
        if outlook.queued:
            return "abort"  # not started: nothing to race with, all of its compute saved
        if outlook.compute_s <= AUTO_FINISH_WITHIN_S:
            return "finish"  # little compute to save, whatever the fitted overhead says
        return "finish" if outlook.remaining_s <= AUTO_FINISH_WITHIN_S else "abort"
