"""A fake NVML for agents the tests start as processes (``FTD_NVML_MODULE=fake_nvml``, with this folder on
``PYTHONPATH``), driven from the test through a JSON file named by ``$FTD_FAKE_NVML``:

``{"gpus": 2, "xids": [[1, 79]], "hang": false}``: two healthy GPUs; every ``[gpu, xid]`` pair is
delivered once as a critical XID event; while ``hang`` is true every device query blocks (a hung
driver), until the file says otherwise. :func:`write` is how a test changes it.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

_ENV = "FTD_FAKE_NVML"
_delivered = 0  # XID events handed out so far by this process
_idle = threading.Event()  # never set: waits between reads of the file while hung


class NVMLError(Exception):
    def __init__(self, value: int, text: str) -> None:
        super().__init__(text)
        self.value = value


def write(path: Path, gpus: int = 2, xids: tuple[tuple[int, int], ...] = (), hang: bool = False) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"gpus": gpus, "xids": [list(x) for x in xids], "hang": hang}))
    os.replace(tmp, path)


def _state() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(Path(os.environ[_ENV]).read_text())
    return doc


def _query() -> dict[str, Any]:
    """The state, once the fake driver is not hung."""
    while (state := _state())["hang"]:
        _idle.wait(0.05)
    return state


def nvmlInit() -> None:
    _state()


def nvmlShutdown() -> None:
    pass


def nvmlDeviceGetCount() -> int:
    return int(_query()["gpus"])


def nvmlDeviceGetHandleByIndex(i: int) -> int:
    return i


def nvmlDeviceGetIndex(handle: int) -> int:
    return handle


def nvmlDeviceGetTemperature(handle: int, sensor: int) -> int:
    _query()
    return 40


def nvmlDeviceGetTotalEccErrors(handle: int, error_type: int, counter: int) -> int:
    _query()
    return 0


class _Utilization:
    gpu = 50


class _Memory:
    used = 1 << 30


def nvmlDeviceGetUtilizationRates(handle: int) -> _Utilization:
    _query()
    return _Utilization()


def nvmlDeviceGetMemoryInfo(handle: int) -> _Memory:
    _query()
    return _Memory()


def nvmlEventSetCreate() -> str:
    return "events"


def nvmlDeviceRegisterEvents(handle: int, types: int, event_set: str) -> None:
    pass


class _EventData:
    def __init__(self, gpu: int, xid: int) -> None:
        self.device, self.eventData = gpu, xid


def nvmlEventSetWait(event_set: str, timeout_ms: int) -> _EventData:
    global _delivered
    pending = _state()["xids"][_delivered:]
    if not pending:
        raise NVMLError(10, "Timeout")
    _delivered += 1
    gpu, xid = pending[0]
    return _EventData(int(gpu), int(xid))


def nvmlEventSetFree(event_set: str) -> None:
    pass
