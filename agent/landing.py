"""The landing reserve: room prepared in the memory tier for the copies a restore will pull, so that
they land at network speed.

Bytes pulled from a peer must end up in tmpfs pages (the restoring process maps the file). Landing
them in pages the node does not hold yet costs more than moving them: on tmpfs each new 4 KiB page
is allocated and zeroed as the bytes come, and writing through a fresh mapping faults every page in
(measured here for 1 GiB: ``pwrite`` into a new file 0.39 CPU-s, into pages allocated beforehand
0.25, a copy into pages mapped beforehand 0.14; the receive, decryption and checksum together cost
about as much as the first of these). A spare waits for exactly this moment, so its agent prepares
the room ahead: files allocated (``posix_fallocate``) and mapped with their pages in
(``MAP_POPULATE``), in the background, within the memory tier's budget. A pulled file that fits a
prepared slot is received straight into the slot's mapping, decrypted in place, checked, truncated
to its size and renamed into place; one that does not fit lands the ordinary way.

How much room (:func:`plan`, a pure function): on a spare, for the newest step of each job that is
held in memory by every rank, what a replacement node would pull: the shards of one node's share of
the world (``ceil(world / nodes in the world)`` of the largest), one slot each. A slot taken is not
made again until the next plan still wants it (a promoted spare plans none), and never while a pull
is in flight or within :data:`QUIET_S` after one: preparing a GiB of room costs about a CPU-second,
which the restore it serves must not pay. The filling thread runs at a lower priority (nice 10).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import math
import mmap
import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

from ftd.checkpoints.catalog import MEMORY, CheckpointRecord

log = logging.getLogger("ftd.agent.landing")

GRANULE = 64 << 20  # slot capacities are rounded up to this: a shard that grows a little fits the same slot
SLACK = 64  # bytes a slot holds beyond the file (the cipher writes up to a block past the bytes it opens)
MIN_FILE = 8 << 20  # smaller files land the ordinary way: preparing room for them gains nothing
QUIET_S = 10.0  # no slot is prepared within this long after a pull ended


def plan(records: Iterable[CheckpointRecord], nodes_in_world: int, room: int) -> tuple[list[int], str]:
    """The slot capacities a spare should hold, largest first, and why. ``records``: the catalog's
    checkpoints (any jobs); ``room``: the bytes the memory tier may give the reserve."""
    best: list[int] = []
    why = "no step is held in memory by every rank"
    newest: dict[str, CheckpointRecord] = {}
    for rec in records:
        if rec.invalid_reason or not rec.complete:
            continue
        if not all(any(c.tier == MEMORY for c in s.good_copies()) for s in rec.shards.values()):
            continue
        if rec.job not in newest or rec.step > newest[rec.job].step:
            newest[rec.job] = rec
    for job, rec in sorted(newest.items()):
        largest = sorted((max((f.size for f in s.files), default=0) for s in rec.shards.values()), reverse=True)
        share = math.ceil(rec.world_size / max(1, nodes_in_world))
        sizes = [capacity_for(n) for n in largest[:share] if n >= MIN_FILE]
        if sum(sizes) > sum(best):
            best = sizes
            why = f"job {job} step {rec.step}: {share} of {rec.world_size} shards per node"
    kept: list[int] = []
    for size in best:
        if sum(kept) + size <= room:
            kept.append(size)
    if len(kept) < len(best):
        why += f"; {len(kept)} of {len(best)} slots fit the {room >> 20} MiB the memory tier allows"
    return kept, why


def capacity_for(size: int) -> int:
    """The slot capacity a file of ``size`` bytes lands in."""
    return -(-(size + SLACK) // GRANULE) * GRANULE


class Slot:
    """One prepared file: allocated, mapped, its pages in. Used once: :meth:`finish` or :meth:`discard`."""

    def __init__(self, path: Path, capacity: int, fd: int | None = None) -> None:
        self.path, self.capacity = path, capacity
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600) if fd is None else fd
        try:
            have = os.fstat(self.fd).st_size if fd is not None else 0  # an adopted file's pages are there already
            if have < capacity:
                os.posix_fallocate(self.fd, have, capacity - have)
            self.map = mmap.mmap(self.fd, capacity, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                                 prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            self._close()
            with contextlib.suppress(OSError):
                path.unlink()
            raise

    def finish(self, final: Path, size: int) -> None:
        """Truncates the slot to the ``size`` bytes it received and renames it to ``final``; the
        mapping is released in the background (unmapping a GiB costs about 0.08 s)."""
        os.ftruncate(self.fd, size)
        os.replace(self.path, final)
        threading.Thread(target=self._close, name="ftd-landing-unmap", daemon=True).start()

    def discard(self) -> None:
        self._close()
        with contextlib.suppress(OSError):
            self.path.unlink()

    def _close(self) -> None:
        with contextlib.suppress(AttributeError, BufferError):
            self.map.close()
        with contextlib.suppress(OSError):
            os.close(self.fd)


def reclaim(folder: Path, trash: Path, wanted: Mapping[str, int]) -> dict[str, Slot]:
    """The pages of a snapshot the keep rule evicts, as the slots the next one of the same rank lands
    in: ``folder`` (published, about to go) is renamed to ``trash`` (gone for readers as a whole) and
    each of its files named in ``wanted`` (file name → the incoming size, at least :data:`MIN_FILE`)
    becomes a slot of that size — its pages are reused: nothing freed or allocated but the
    difference in size, the mapping populated at 0.05 CPU-s per GiB where landing in fresh pages
    costs 0.33 and freeing the old ones 0.05 (measured here) — provided no
    other descriptor or mapping, in any process, holds it: a reader's bytes never change under it
    (a write lease is granted only to a file nobody else holds; asked before and after the rename).
    The caller removes ``trash`` (and discards the slots it did not use)."""
    held: dict[str, int] = {}
    try:
        for name, size in wanted.items():
            if size < MIN_FILE:
                continue
            try:
                fd = os.open(folder / name, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
            except OSError:
                continue
            if _alone(fd):
                held[name] = fd
            else:
                os.close(fd)
        os.rename(folder, trash)
    except OSError as exc:
        for fd in held.values():
            os.close(fd)
        log.debug("nothing reclaimed from %s: %s", folder, exc)
        return {}
    slots: dict[str, Slot] = {}
    for name, fd in held.items():
        path = trash / name
        if not _alone(fd):  # opened between the first look and the rename: left to its reader
            os.close(fd)
            continue
        try:
            slots[name] = Slot(path, wanted[name] + SLACK, fd)  # used once, for a known size: no granule
        except OSError as exc:  # the fd is closed, the file removed
            log.debug("%s not reused as a slot: %s", path, exc)
    return slots


def _alone(fd: int) -> bool:
    """Whether no other descriptor or mapping holds the file of ``fd`` (Linux grants a write lease only
    then; a file system without leases answers no)."""
    try:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
    except OSError:
        return False
    fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
    return True


class LandingReserve:
    """The slots of one agent, under ``root`` (inside the memory tier, so that they count against its
    budget), filled by a background thread towards the capacities :meth:`set_target` asked for."""

    def __init__(self, root: Path, on_change: Callable[[int], None] = lambda ready: None,
                 on_take: Callable[[], None] = lambda: None, clock: Callable[[], float] = time.monotonic) -> None:
        self.root = root
        self.on_change = on_change  # called with the bytes ready, whenever they change
        self.on_take = on_take  # called when a pulled file lands in a slot
        self.clock = clock
        self._pulls = 0
        self._quiet_from = -1e18  # the fill waits until then (QUIET_S after the last pull ended)
        self._want: list[int] = []
        self._ready: list[Slot] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        shutil.rmtree(root, ignore_errors=True)  # slots a previous run left behind
        self._thread: threading.Thread | None = None

    @property
    def ready_bytes(self) -> int:
        with self._lock:
            return sum(s.capacity for s in self._ready)

    @property
    def wanted(self) -> list[int]:
        with self._lock:
            return list(self._want)

    def set_target(self, capacities: list[int]) -> None:
        """The slots wanted now (capacities from :func:`plan`); slots no longer wanted are freed."""
        drop: list[Slot] = []
        with self._lock:
            self._want = sorted(capacities, reverse=True)
            keep: list[Slot] = []
            wanted = list(self._want)
            for slot in sorted(self._ready, key=lambda s: -s.capacity):
                if slot.capacity in wanted:
                    wanted.remove(slot.capacity)
                    keep.append(slot)
                else:
                    drop.append(slot)
            self._ready = keep
            if wanted and self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._fill, name="ftd-landing-fill", daemon=True)
                self._thread.start()
        for slot in drop:
            slot.discard()
        if drop:
            self.on_change(self.ready_bytes)
        self._wake.set()

    @contextlib.contextmanager
    def pulling(self) -> Iterator[None]:
        """Around a pull: no slot is prepared meanwhile, nor within :data:`QUIET_S` after it."""
        with self._lock:
            self._pulls += 1
        try:
            yield
        finally:
            with self._lock:
                self._pulls -= 1
                self._quiet_from = self.clock() + QUIET_S
            self._wake.set()

    def take(self, name: str, size: int) -> Slot | None:
        """The smallest ready slot that holds ``size`` bytes (``None``: land the ordinary way). The
        slot leaves the reserve and the target: it is made again only if the next plan wants it."""
        if size < MIN_FILE:
            return None
        with self._lock:
            fits = [s for s in self._ready if s.capacity >= size + SLACK]
            if not fits:
                return None
            slot = min(fits, key=lambda s: s.capacity)
            self._ready.remove(slot)
            with contextlib.suppress(ValueError):
                self._want.remove(slot.capacity)
        self.on_change(self.ready_bytes)
        self.on_take()
        log.debug("%s (%d bytes) lands in a prepared slot of %d MiB", name, size, slot.capacity >> 20)
        return slot

    def close(self) -> None:
        with self._lock:
            self._closed = True
            slots, self._ready = self._ready, []
        self._wake.set()
        for slot in slots:
            slot.discard()
        shutil.rmtree(self.root, ignore_errors=True)

    def _missing(self) -> int | None:
        """The capacity of the next slot to prepare, 0 for none now, ``None`` once closed."""
        with self._lock:
            if self._closed:
                return None
            if self._pulls or self.clock() < self._quiet_from:
                return 0
            wanted = list(self._want)
            for slot in self._ready:
                if slot.capacity in wanted:
                    wanted.remove(slot.capacity)
            return wanted[0] if wanted else 0

    def _fill(self) -> None:
        """Makes the missing slots one at a time (each is a GiB of page allocation and mapping: a
        background job on an idle node, at a lower priority), then sleeps until the target changes."""
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)  # this thread only (Linux)
        while True:
            capacity = self._missing()
            if capacity is None:
                return
            if capacity == 0:
                self._wake.wait(timeout=1.0)  # also wakes to see the quiet period end
                self._wake.clear()
                continue
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                slot = Slot(self.root / f"slot-{secrets.token_hex(6)}", capacity)
            except Exception as exc:  # the thread must outlive any failure: the next plan asks again
                log.warning("landing reserve: cannot prepare a %d MiB slot in %s (%s); restores land the ordinary "
                            "way", capacity >> 20, self.root, exc)
                with self._lock:
                    self._want = []
                continue
            with self._lock:
                if self._closed or capacity not in self._want:
                    stale = True
                else:
                    stale = False
                    self._ready.append(slot)
            if stale:
                slot.discard()
                continue
            self.on_change(self.ready_bytes)


__all__ = ["GRANULE", "MIN_FILE", "LandingReserve", "Slot", "capacity_for", "plan", "reclaim"]
