"""A vLLM-compatible engine emulator with an emulated NIXL KV side channel (docs/emulator.md)."""

from sidecar.emulator.app import RunningEmulator, start_emulator
from sidecar.emulator.config import EmulatorConfig
from sidecar.emulator.faults import FaultKind, FaultRole, FaultSpec

__all__ = [
    "EmulatorConfig",
    "FaultKind",
    "FaultRole",
    "FaultSpec",
    "RunningEmulator",
    "start_emulator",
]
