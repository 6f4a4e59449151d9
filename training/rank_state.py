"""What a rank needs besides its model and optimizer to continue exactly: its RNG states and the
position of its data loader.

A recovered run is bit-identical to an uninterrupted one only if every random draw after the restore
(dropout, data shuffling, augmentation) is the one the uninterrupted run made, and every rank reads
the batches it would have read. So every shard holds, next to the state, the file :data:`FILE`: this
rank's python ``random``, numpy (when numpy is loaded), torch CPU and CUDA (when CUDA is initialised)
generator states, and the ``state_dict()`` of an optional ``Stateful`` data loader, captured with the
snapshot (the same instant as the state). It is per rank and never resharded: a rank restores the one
of the shard it reads. It is written with ``torch.save`` and read with ``weights_only=True`` after its
CRC32C was checked like every file of the shard, so it holds only tensors and plain values (the RNG
states are stored as integer tensors; a data loader's ``state_dict()`` must hold only what
``weights_only`` loads: tensors, numbers, strings, lists, dicts).
"""

from __future__ import annotations

import copy
import importlib
import logging
import random
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("ftd.training.rank_state")
FILE = "ftd_rank_state.pt"  # in every shard folder, next to state.pt or the dcp files


class RankState:
    """This rank's RNG states (``rng``) and its data loader's position (``dataloader``: anything with
    ``state_dict()``/``load_state_dict()``), captured at each save and applied at each restore."""

    def __init__(self, dataloader: Any = None, rng: bool = True) -> None:
        if dataloader is not None and not (callable(getattr(dataloader, "state_dict", None))
                                           and callable(getattr(dataloader, "load_state_dict", None))):
            raise TypeError(f"dataloader= needs state_dict() and load_state_dict() (a DCP Stateful); "
                            f"got a {type(dataloader).__name__}")
        self.dataloader = dataloader
        self.rng = rng

    @property
    def enabled(self) -> bool:
        return self.rng or self.dataloader is not None

    def capture(self) -> dict[str, Any]:
        """The states now (copies: the live generators and loader go on)."""
        out: dict[str, Any] = {}
        if self.rng:
            out["rng"] = rng_states()
        if self.dataloader is not None:
            out["dataloader"] = copy.deepcopy(self.dataloader.state_dict())
        return out

    def apply(self, saved: Mapping[str, Any]) -> list[str]:
        """Sets what ``saved`` holds and this rank asked for; returns what was restored."""
        done: list[str] = []
        if self.rng and "rng" in saved:
            done += set_rng_states(saved["rng"])
        if self.dataloader is not None and "dataloader" in saved:
            self.dataloader.load_state_dict(saved["dataloader"])
            done.append("dataloader")
        return done

    def skip(self, steps: int) -> list[str]:
        """After a rollback past a step anomaly with ``skip_batches``: the loader skips the data of the
        next ``steps`` steps (the window that led to the anomaly), through its ``skip_batches(steps)``
        (the loader knows how many batches a step takes). A loader without one skips nothing, said."""
        skip = getattr(self.dataloader, "skip_batches", None)
        if steps <= 0:
            return []
        if not callable(skip):
            log.warning("the rollback asks to skip the data of %d step(s), but the data loader (%s) has no "
                        "skip_batches(steps): nothing is skipped", steps, type(self.dataloader).__name__)
            return []
        skip(steps)
        return [f"skipped the data of {steps} step(s)"]


def rng_states() -> dict[str, Any]:
    """Every generator this process uses, as tensors and plain values."""
    version, internal, gauss = random.getstate()
    out: dict[str, Any] = {"python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64),
                                      "gauss": gauss},
                           "torch": torch.get_rng_state()}
    np = sys.modules.get("numpy")
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        out["numpy"] = {"kind": str(kind), "keys": torch.tensor(keys.astype("int64").tolist(), dtype=torch.int64),
                        "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_states(saved: Mapping[str, Any]) -> list[str]:
    """Sets the generators :func:`rng_states` captured; returns their names."""
    done = []
    if "python" in saved:
        py = saved["python"]
        random.setstate((py["version"], tuple(int(v) for v in py["state"].tolist()), py["gauss"]))
        done.append("python")
    if "torch" in saved:
        torch.set_rng_state(saved["torch"])
        done.append("torch")
    if "numpy" in saved:
        try:
            np = importlib.import_module("numpy")
        except ImportError:
            pass
        else:
            n = saved["numpy"]
            np.random.set_state((n["kind"], np.array(n["keys"].tolist(), dtype=np.uint32), n["pos"], n["has_gauss"],
                                 n["cached"]))
            done.append("numpy")
    if "cuda" in saved and torch.cuda.is_available():
        states = list(saved["cuda"])[:torch.cuda.device_count()]
        for device, state in enumerate(states):
            torch.cuda.set_rng_state(state, device)
        done.append("cuda")
    return done


def write(directory: Path, captured: Mapping[str, Any]) -> None:
    torch.save(dict(captured), directory / FILE)


def read(directory: Path) -> dict[str, Any]:
    """The file of a shard whose CRC32Cs were checked (weights_only: tensors and plain values only)."""
    loaded = torch.load(directory / FILE, map_location="cpu", weights_only=True)
    if not isinstance(loaded, dict):
        raise ValueError(f"{directory / FILE} holds a {type(loaded).__name__}, not the rank state")
    return loaded
