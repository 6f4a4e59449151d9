"""A storage tier on a local directory: the SSD hot tier, the HDD warm tier, any mounted filesystem.

Why each step is there:

* **An object appears whole or not at all.** Bytes go to a hidden temp file in the destination's own
  directory (``.<name>.ftd-tmp-<hex>``, same filesystem, so the rename is atomic), the file is
  fsynced, ``os.replace``-d into place and the directory fsynced: after a crash or power cut a reader
  sees the old object or the new one, never a torn one.
* **The CRC32C is computed while streaming and kept in an xattr** (``user.ftd.crc32c``) so
  :meth:`LocalBackend.stat` and :meth:`LocalBackend.get_file` can verify later without a second
  read at write time. A filesystem that refuses user xattrs just yields ``crc32c=None``.
* **Atomic publish renames a hidden staging dir** (``.<name>.ftd-stage-<hex>``, next to the final
  folder) with ``RENAME_NOREPLACE`` after fsyncing every file and dir: a folder is visible complete,
  with its marker, or not at all, and a published folder is never replaced.
* **Deleting a folder renames it to a hidden trash name first**, so a half-deleted folder is never
  visible under its real name; :meth:`LocalBackend.cleanup` finishes what an interrupted delete,
  put or staging left behind.
* **Reserved names.** A key segment that starts with ``.`` and contains ``ftd-`` is ftd's own
  (temp files, staging and trash dirs, upload journals): :meth:`LocalBackend.list` skips such
  entries and keys using them are refused with :class:`InvalidKey`.

* **Writers that need paths write in place.** :meth:`LocalStaging.local_dir` is the hidden staging
  dir itself, so ``torch.save`` writes the final bytes once; :meth:`LocalStaging.publish` fsyncs
  those files with the rest, and :meth:`LocalBackend.local_folder` hands a published folder out as is.

OS errors are translated once (:func:`.atomic_files.os_error`): ENOSPC/EDQUOT → :class:`StorageFull`,
a missing object on read → :class:`ObjectNotFound`, anything else → :class:`StorageError`, the cause
chained. On any failure the temp file or dir is removed, so a full disk leaves no partial files and
published data is never touched.
"""

from __future__ import annotations

import builtins
import ctypes
import errno
import io
import logging
import os
import re
import shutil
import stat as stat_mod
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, suppress
from pathlib import Path
from typing import Any, BinaryIO

from .atomic_files import (
    AtomicFile,
    copy_into,
    fsync_dir,
    fsync_file,
    in_folder,
    leftover_name,
    os_error,
    read_crc_xattr,
)
from .base import (
    AlreadyPublished,
    ChecksumMismatch,
    InvalidKey,
    ObjectInfo,
    ObjectNotFound,
    Progress,
    StorageError,
    check_key,
    crc32c_file,
    folder_of,
    is_reserved,
)

log = logging.getLogger(__name__)

# What an interrupted writer or delete leaves behind: .<name>.ftd-<kind>-<12 hex>.
_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.ftd-(?P<kind>tmp|stage|trash)-[0-9a-f]{12}$")
_MISSING_ERRNOS = (errno.ENOENT, errno.ENOTDIR, errno.EISDIR)


def _libc_renameat2() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_RENAMEAT2 = _libc_renameat2()
_AT_FDCWD = -100
_RENAME_NOREPLACE = 1


def rename_noreplace(src: Path, dst: Path) -> None:
    """Renames ``src`` to ``dst``; ``FileExistsError`` if ``dst`` exists (even an empty dir, which a
    plain rename would silently replace). Falls back to check-then-rename where the kernel or
    filesystem lacks ``renameat2(RENAME_NOREPLACE)``."""
    if _RENAMEAT2 is not None:
        rc = int(_RENAMEAT2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE))
        if rc == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS):
            raise OSError(err, os.strerror(err), str(dst))
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))
    os.rename(src, dst)


# ---- the backend -------------------------------------------------------------------------------


class LocalBackend:
    """:class:`~.base.StorageBackend` (and :class:`~.base.InPlace`) on a directory. ``root`` is
    created on the first write."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)
        self.name = f"local:{self.root}"
        self._real_root = Path(os.path.realpath(self.root))

    @staticmethod
    def hash_file(path: Path) -> str:
        """A staged file's CRC32C (a subclass in memory hashes mapped pages instead of reading)."""
        return crc32c_file(path)

    # ---- paths ----

    def _path(self, key: str, *, obj: bool = True) -> Path:
        check_key(self.name, key, obj=obj)
        path = self.root / key
        real = Path(os.path.realpath(path))
        if real != self._real_root and self._real_root not in real.parents:
            raise InvalidKey(self.name, key, f"resolves to {real}, outside the tier root {self._real_root}")
        return path

    def _walk_base(self, prefix: str) -> tuple[Path, str]:
        """Where a walk for the string prefix ``prefix`` starts (its last complete folder, checked
        to be inside the root) and the partial name that follows it."""
        check_key(self.name, prefix, allow_empty=True)
        base_rel, _, partial = prefix.rpartition("/")
        return (self._path(base_rel, obj=False) if base_rel else self.root), partial

    def _key(self, path: Path) -> str:
        return path.relative_to(self.root).as_posix()

    def _info(self, key: str, path: Path) -> ObjectInfo | None:
        try:
            st = os.stat(path)
        except OSError as exc:
            if exc.errno in _MISSING_ERRNOS:
                return None
            raise os_error(self.name, key, path, exc, "stat") from exc
        if not stat_mod.S_ISREG(st.st_mode):
            return None
        return ObjectInfo(key, st.st_size, st.st_mtime, read_crc_xattr(path))

    def _open(self, key: str, path: Path) -> BinaryIO:
        try:
            if os.path.isdir(path):
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
            return open(path, "rb")
        except OSError as exc:
            if exc.errno in _MISSING_ERRNOS:
                raise ObjectNotFound(self.name, key, f"no such object ({path})") from exc
            raise os_error(self.name, key, path, exc, "open") from exc

    # ---- objects ----

    def put_stream(self, key: str, src: BinaryIO, progress: Progress | None = None) -> ObjectInfo:
        return self._put(key, self._path(key), src, progress)

    def _put(self, key: str, dest: Path, src: BinaryIO, progress: Progress | None) -> ObjectInfo:
        with AtomicFile(dest, backend=self.name, key=key) as out:
            copy_into(out, src, progress)
            crc = out.crc32c()
            out.commit(crc_xattr=crc)
        return ObjectInfo(key, out.size, time.time(), crc)

    def put_file(self, key: str, path: Path, progress: Progress | None = None) -> ObjectInfo:
        dest = self._path(key)
        with open(path, "rb") as src:  # a missing source is the caller's error, raised as is
            return self._put(key, dest, src, progress)

    def open_read(self, key: str) -> AbstractContextManager[BinaryIO]:
        return self._open(key, self._path(key))

    def get_file(self, key: str, path: Path, progress: Progress | None = None) -> ObjectInfo:
        src_path = self._path(key)
        with self._open(key, src_path) as src:
            expected = read_crc_xattr(src.fileno())
            mtime = os.fstat(src.fileno()).st_mtime
            with AtomicFile(Path(path), backend=self.name, key=key) as out:
                try:
                    copy_into(out, src, progress)
                except OSError as exc:  # reading the tier's own file
                    raise os_error(self.name, key, src_path, exc, "read") from exc
                actual = out.crc32c()
                if expected is not None and actual != expected:
                    raise ChecksumMismatch(
                        self.name, key, f"CRC32C mismatch reading {src_path}: expected {expected}, got {actual}"
                    )
                out.commit()
        return ObjectInfo(key, out.size, mtime, actual)

    def folder_path(self, prefix: str) -> Path:
        """:class:`~.base.InPlace`: the folder's directory (the key checked like any other)."""
        return self._path(folder_of(prefix), obj=False)

    @contextmanager
    def local_folder(self, prefix: str, names: Iterable[str]) -> Iterator[Path]:
        """The folder itself: its files are already local (no copy, nothing verified here)."""
        folder = self.folder_path(prefix)
        for name in names:
            check_key(self.name, name, obj=True)
        yield folder

    def stat(self, key: str) -> ObjectInfo | None:
        return self._info(key, self._path(key))

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        base, partial = self._walk_base(prefix)
        keys: list[str] = []
        for dirpath, dirnames, filenames in os.walk(base):
            here = Path(dirpath)
            top = here == base
            dirnames[:] = [d for d in dirnames if not is_reserved(d) and (not top or d.startswith(partial))]
            for f in filenames:
                if is_reserved(f):
                    continue
                key = self._key(here / f)
                if key.startswith(prefix):
                    keys.append(key)
        for key in sorted(keys):
            info = self._info(key, self.root / key)
            if info is not None:  # removed since the walk
                yield info

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            os.unlink(path)
        except OSError as exc:
            if exc.errno in (*_MISSING_ERRNOS, errno.EPERM) and not path.is_file():
                return  # missing, or a folder (not an object): nothing to delete
            raise os_error(self.name, key, path, exc, "delete") from exc
        try:
            fsync_dir(path.parent)
        except OSError as exc:
            raise os_error(self.name, key, path.parent, exc, "fsync") from exc

    def delete_prefix(self, prefix: str, *, marker_name: str | None = None) -> int:
        """Deletes the folder ``prefix``; returns the number of objects deleted. ``marker_name`` is
        accepted for parity with the S3 tier and unused: the folder is renamed to a hidden trash
        name first, so it vanishes as a whole."""
        final = self._path(folder_of(prefix), obj=False)
        if not final.is_dir():
            return 0
        trash = leftover_name(final, "trash")
        try:
            os.rename(final, trash)
            fsync_dir(final.parent)
        except OSError as exc:
            if exc.errno == errno.ENOENT:  # deleted concurrently
                return 0
            raise os_error(self.name, prefix, final, exc, "delete") from exc
        count = 0
        for _, dirnames, filenames in os.walk(trash):
            dirnames[:] = [d for d in dirnames if not is_reserved(d)]
            count += sum(1 for f in filenames if not is_reserved(f))
        try:
            shutil.rmtree(trash)
        except OSError as exc:  # the trash is hidden; cleanup finishes it
            raise os_error(self.name, prefix, trash, exc, "delete") from exc
        self._drop_if_empty(final.parent)
        return count

    def _drop_if_empty(self, folder: Path) -> None:
        """Removes ``folder`` (a step's, once its last rank went) when nothing is left in it: empty step
        folders would otherwise pile up, one per step saved, and every scan of the tier (the memory
        tier's snapshot list on each save, the tiering inventory) walks them all. A writer that made
        the folder just now and finds it gone makes it again (:func:`_in_folder`)."""
        if folder == self.root or self.root not in folder.parents:
            return
        try:
            os.rmdir(folder)
        except OSError:  # not empty (another rank's, a writer's), or gone already
            return
        with suppress(OSError):
            fsync_dir(folder.parent)

    # ---- folders ----

    def stage(self, prefix: str) -> LocalStaging:
        key = folder_of(prefix)
        final = self._path(key, obj=False)
        if _nonempty(final):
            raise AlreadyPublished(self.name, key, f"{final} already exists; a folder is never reused")
        tmp = leftover_name(final, "stage")
        try:
            in_folder(final.parent, tmp.mkdir)
        except OSError as exc:
            raise os_error(self.name, key, final, exc, "stage") from exc
        return LocalStaging(self, key, final, tmp)

    def is_published(self, prefix: str, marker_name: str) -> bool:
        check_key(self.name, marker_name, obj=True)
        final = self._path(folder_of(prefix), obj=False)
        return (final / marker_name).is_file()

    def cleanup(
        self, prefix: str = "", older_than_s: float = 0.0, *, marker_name: str | None = None,
        select: Callable[[str], bool] | None = None,
    ) -> builtins.list[str]:
        """Removes temp files, staging dirs and trash (from interrupted puts, writers and deletes)
        whose newest entry is older than ``older_than_s``. Published folders hold none of these, so
        they are never touched. ``marker_name`` is accepted for parity with the S3 tier and unused:
        leftovers are recognised by name here."""
        base, partial = self._walk_base(prefix)
        cutoff = time.time() - older_than_s
        removed: list[str] = []
        for dirpath, dirnames, filenames in os.walk(base):
            here = Path(dirpath)
            if here == base:
                dirnames[:] = [d for d in dirnames if d.startswith(partial) or _LEFTOVER.match(d)]
            for name in [*dirnames, *filenames]:
                m = _LEFTOVER.match(name)
                if m is None:
                    continue
                entry = here / name
                logical = self._key(here / m.group("name"))
                if not logical.startswith(prefix) or (select is not None and not select(logical)):
                    continue
                if _newest_mtime(entry) > cutoff:
                    continue
                try:
                    if entry.is_dir() and not entry.is_symlink():
                        shutil.rmtree(entry)
                    else:
                        entry.unlink()
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    raise os_error(self.name, logical, entry, exc, "cleanup") from exc
                log.info("%s: removed leftover %s", self.name, entry)
                removed.append(self._key(entry))
            dirnames[:] = [d for d in dirnames if not is_reserved(d)]
        return sorted(removed)


def _nonempty(path: Path) -> bool:
    """A path exists as something other than an empty dir (an empty dir is what deleting a folder's
    last object leaves behind; it does not make a folder published)."""
    try:
        if not path.is_dir():
            return os.path.lexists(path)
        with os.scandir(path) as it:
            return any(True for _ in it)
    except OSError:
        return True


def _newest_mtime(path: Path) -> float:
    """The newest mtime of a file or of a tree: a staging dir still being written is not abandoned."""
    try:
        newest = path.lstat().st_mtime
    except OSError:
        return float("inf")  # vanished: leave it to whoever removed it
    if path.is_dir() and not path.is_symlink():
        for dirpath, dirnames, filenames in os.walk(path):
            for name in [*dirnames, *filenames]:
                with suppress(OSError):
                    newest = max(newest, os.lstat(os.path.join(dirpath, name)).st_mtime)
    return newest


class LocalStaging:
    """A folder written into a hidden temp dir and renamed into place by :meth:`publish`."""

    def __init__(self, backend: LocalBackend, prefix: str, final: Path, tmp: Path) -> None:
        self.backend = backend
        self.prefix = prefix
        self.final = final
        self.tmp = tmp
        self._state = "open"  # -> "published" | "aborted"
        self._put: dict[str, ObjectInfo] = {}  # name -> what put_* wrote (already fsynced, CRC32C known)

    def _check_open(self) -> None:
        if self._state == "published":
            raise AlreadyPublished(self.backend.name, self.prefix, "this staging was already published")
        if self._state == "aborted":
            raise StorageError(self.backend.name, self.prefix, "this staging was aborted")

    def _dest(self, name: str) -> tuple[str, Path]:
        self._check_open()
        check_key(self.backend.name, name, obj=True)
        return f"{self.prefix}/{name}", self.tmp / name

    def _record(self, name: str, info: ObjectInfo) -> ObjectInfo:
        self._put[name] = info
        return info

    def put_stream(self, name: str, src: BinaryIO, progress: Progress | None = None) -> ObjectInfo:
        key, dest = self._dest(name)
        return self._record(name, self.backend._put(key, dest, src, progress))

    def put_file(self, name: str, path: Path, progress: Progress | None = None) -> ObjectInfo:
        key, dest = self._dest(name)
        with open(path, "rb") as src:
            return self._record(name, self.backend._put(key, dest, src, progress))

    def local_dir(self) -> Path:
        """The staging dir itself: files written here are the folder's final bytes (no copy)."""
        self._check_open()
        return self.tmp

    def _files(self) -> list[str]:
        """Every regular file of the staged tree, relative, sorted (ftd's own temp names skipped)."""
        out: list[str] = []
        for dirpath, dirnames, filenames in os.walk(self.tmp):
            dirnames[:] = [d for d in dirnames if not is_reserved(d)]
            here = Path(dirpath)
            out += [(here / f).relative_to(self.tmp).as_posix() for f in filenames
                    if not is_reserved(f) and (here / f).is_file()]
        return sorted(out)

    def objects(self) -> list[ObjectInfo]:
        self._check_open()
        out: list[ObjectInfo] = []
        for name in self._files():
            check_key(self.backend.name, name, obj=True)
            known = self._put.get(name)
            path = self.tmp / name
            try:
                if known is not None and known.crc32c is not None:
                    out.append(ObjectInfo(name, known.size, known.mtime, known.crc32c))
                else:
                    st = path.stat()
                    out.append(ObjectInfo(name, st.st_size, st.st_mtime, self.backend.hash_file(path)))
            except OSError as exc:
                raise os_error(self.backend.name, f"{self.prefix}/{name}", path, exc, "read") from exc
        return out

    def publish(self, marker_name: str, marker: bytes) -> None:
        """Fsyncs the files written into :meth:`local_dir` (``put_*`` objects were fsynced as they
        were written), writes the marker last, fsyncs every dir of the staged tree and renames the
        tree into place without replacing anything."""
        key, dest = self._dest(marker_name)
        name = self.backend.name
        try:
            for rel in self._files():
                if rel not in self._put:
                    fsync_file(self.tmp / rel)
        except OSError as exc:
            raise os_error(name, self.prefix, self.tmp, exc, "fsync") from exc
        self.backend._put(key, dest, io.BytesIO(marker), None)
        try:
            for dirpath, _, _ in os.walk(self.tmp):
                fsync_dir(Path(dirpath))
            if self.final.is_dir() and not _nonempty(self.final):
                with suppress(OSError):
                    self.final.rmdir()
            rename_noreplace(self.tmp, self.final)
            fsync_dir(self.final.parent)
        except OSError as exc:
            if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
                why = f"{self.final} already exists; a folder is never reused"
                raise AlreadyPublished(name, self.prefix, why) from exc
            raise os_error(name, self.prefix, self.final, exc, "publish") from exc
        self._state = "published"

    def abort(self) -> None:
        if self._state != "open":
            return
        try:
            shutil.rmtree(self.tmp)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise os_error(self.backend.name, self.prefix, self.tmp, exc, "abort") from exc
        self._state = "aborted"


__all__ = [
    "LocalBackend",
    "LocalStaging",
    "rename_noreplace",
]
