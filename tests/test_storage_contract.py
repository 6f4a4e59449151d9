"""One contract suite for the storage tiers, run against the local-directory tier, the memory tier
(a directory tier with a budget and a keep rule: the same contract) and the S3 tier talking HTTP to
moto's standalone server; then what only the local tier can show (a full disk, symlinks). What only
the S3 tier can show (multipart resume, retries, an unreachable endpoint) is in test_storage_s3.py."""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from storage_fixtures import MARKER, Interrupt, MiB, MotoServer, blob, count_sends, s3_backend, small_tmpfs

from ftd.storage_backends.base import (
    AlreadyPublished,
    ChecksumMismatch,
    InvalidKey,
    ObjectNotFound,
    StorageError,
    StorageFull,
    crc32c_hex,
    is_reserved,
)
from ftd.storage_backends.local import LocalBackend
from ftd.storage_backends.memory import MemoryTier


def files_under(root: Path) -> list[str]:
    """Every file and dir under ``root`` (relative), hidden ones included."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        out += [os.path.relpath(os.path.join(dirpath, n), root) for n in [*dirnames, *filenames]]
    return sorted(out)


@dataclass
class Tier:
    """A backend under test plus what a test needs to reach behind its back."""

    kind: str
    backend: Any  # LocalBackend | MemoryTier | S3Backend
    corrupt: Callable[[str], None]  # flips a byte of a stored object, keeping its recorded CRC32C
    io_done: Callable[[], bool]  # whether the backend has touched its storage at all
    hides_staged: bool  # whether staged objects are invisible to list() before publish


def local_tier(tmp_path: Path, memory: bool = False) -> Tier:
    root = tmp_path / "tier"  # not created: the first write does it

    def corrupt(key: str) -> None:
        with open(root / key, "r+b") as f:
            first = f.read(1)
            f.seek(0)
            f.write(bytes([first[0] ^ 0xFF]))

    backend = MemoryTier(root, capacity_bytes=1 << 30) if memory else LocalBackend(root)
    return Tier("local", backend, corrupt, root.exists, hides_staged=True)


def s3_tier(moto: MotoServer, tmp_path: Path) -> Tier:
    backend = s3_backend(moto, tmp_path)
    raw = moto.client()
    sent = count_sends(backend)

    def corrupt(key: str) -> None:
        full = backend.prefix + key
        obj = raw.get_object(Bucket=backend.bucket, Key=full)
        data = bytearray(obj["Body"].read())
        data[0] ^= 0xFF
        raw.put_object(Bucket=backend.bucket, Key=full, Body=bytes(data), Metadata=obj["Metadata"])

    return Tier("s3", backend, corrupt, lambda: bool(sent), hides_staged=False)


@pytest.fixture(params=["local", "mem", pytest.param("s3", marks=pytest.mark.s3)])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Tier:
    if request.param in ("local", "mem"):
        return local_tier(tmp_path, memory=request.param == "mem")
    return s3_tier(request.getfixturevalue("moto"), tmp_path)


# ---- the contract -------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1000, 13 * MiB + 7], ids=["empty", "small", "multipart"])
def test_roundtrip_through_every_write_and_read_path(tier: Tier, tmp_path: Path, size: int) -> None:
    b = tier.backend
    data = blob(size, seed=size)
    want = crc32c_hex(data)
    src = tmp_path / "src.bin"
    src.write_bytes(data)

    put_s = b.put_stream("job/stream.bin", io.BytesIO(data))
    put_f = b.put_file("job/file.bin", src)
    for info in (put_s, put_f):
        assert (info.size, info.crc32c) == (size, want)
    for key in ("job/stream.bin", "job/file.bin"):
        stat = b.stat(key)
        assert stat is not None and (stat.key, stat.size, stat.crc32c) == (key, size, want)
        with b.open_read(key) as f:
            assert f.read() == data
        dest = tmp_path / "out" / key.replace("/", "_")
        got = b.get_file(key, dest)
        assert (got.size, got.crc32c) == (size, want)
        assert dest.read_bytes() == data
    assert files_under(tmp_path / "out") == ["job_file.bin", "job_stream.bin"]  # no temp files


def test_progress_reports_every_byte_moved(tier: Tier, tmp_path: Path) -> None:
    data = blob(13 * MiB, seed=3)
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    up: list[int] = []
    down: list[int] = []
    tier.backend.put_file("big", src, progress=up.append)
    tier.backend.get_file("big", tmp_path / "back.bin", progress=down.append)
    assert sum(up) == sum(down) == len(data)
    assert len(down) > 1  # reported per chunk, not once at the end


def test_overwriting_an_object_replaces_it(tier: Tier) -> None:
    tier.backend.put_stream("k", io.BytesIO(b"first"))
    tier.backend.put_stream("k", io.BytesIO(b"second!"))
    info = tier.backend.stat("k")
    assert info is not None and (info.size, info.crc32c) == (7, crc32c_hex(b"second!"))
    with tier.backend.open_read("k") as f:
        assert f.read() == b"second!"


def test_stat_is_none_for_a_missing_object_or_a_folder(tier: Tier) -> None:
    assert tier.backend.stat("nope/none") is None
    tier.backend.put_stream("dir/obj", io.BytesIO(b"x"))
    assert tier.backend.stat("dir") is None
    assert tier.backend.stat("dir/obj") is not None


def test_missing_objects_raise_object_not_found(tier: Tier, tmp_path: Path) -> None:
    with pytest.raises(ObjectNotFound, match="nope/x"):
        tier.backend.open_read("nope/x")
    dest = tmp_path / "dl" / "x"
    with pytest.raises(ObjectNotFound, match="nope/x"):
        tier.backend.get_file("nope/x", dest)
    assert not dest.exists()
    assert not (dest.parent.exists() and any(dest.parent.iterdir()))  # no temp file left behind


def test_list_is_sorted_recursive_prefix_filtered_and_skips_staging_leftovers(tier: Tier) -> None:
    b = tier.backend
    keys = ["b/2", "a/1", "a/b/3", "ab/4", "c", "a/b/c/5"]
    for i, k in enumerate(keys):
        b.put_stream(k, io.BytesIO(bytes([i]) * (i + 1)))
    staging = b.stage("s/open")
    staging.put_stream("y", io.BytesIO(b"staged"))

    listed = list(b.list())
    staged = [] if tier.hides_staged else ["s/open/y"]
    assert [o.key for o in listed] == sorted(keys) + staged
    assert all(not any(is_reserved(seg) for seg in o.key.split("/")) for o in listed)
    assert {o.key: o.size for o in listed}["a/b/c/5"] == 6
    assert [o.key for o in b.list("a/")] == ["a/1", "a/b/3", "a/b/c/5"]
    assert [o.key for o in b.list("a/b")] == ["a/b/3", "a/b/c/5"]
    assert [o.key for o in b.list("a")] == ["a/1", "a/b/3", "a/b/c/5", "ab/4"]
    assert list(b.list("zzz/")) == []
    staging.abort()


def test_delete_is_idempotent(tier: Tier) -> None:
    tier.backend.put_stream("d/x", io.BytesIO(b"x"))
    tier.backend.delete("d/x")
    assert tier.backend.stat("d/x") is None
    tier.backend.delete("d/x")
    tier.backend.delete("never/was")
    assert list(tier.backend.list()) == []


def test_delete_prefix_removes_exactly_one_folder(tier: Tier) -> None:
    b = tier.backend
    st = b.stage("ckpt/f1")
    st.put_stream("a", io.BytesIO(b"a"))
    st.put_stream("sub/b", io.BytesIO(b"b"))
    st.publish(MARKER, b"{}")
    b.put_stream("ckpt/f10/keep", io.BytesIO(b"k"))  # shares the string prefix, not the folder
    b.put_stream("ckpt/f1x", io.BytesIO(b"k"))

    assert b.delete_prefix("ckpt/f1", marker_name=MARKER) == 3
    assert not b.is_published("ckpt/f1", MARKER)
    assert [o.key for o in b.list("ckpt/")] == ["ckpt/f10/keep", "ckpt/f1x"]
    assert b.delete_prefix("ckpt/f1", marker_name=MARKER) == 0


BAD_KEYS = ["..", "a/../b", "/abs", "", "a//b", "a\\b", "a\x00b", ".", "a/./b", "x/.ftd-staging",
            "a/.b.ftd-tmp-0123456789ab", "x" * 1025]


@pytest.mark.parametrize("bad", BAD_KEYS, ids=[repr(k)[:20] for k in BAD_KEYS])
def test_every_invalid_key_is_refused_before_any_io(tier: Tier, tmp_path: Path, bad: str) -> None:
    b = tier.backend
    src = tmp_path / "src"
    src.write_bytes(b"data")
    ops: list[Callable[[], object]] = [
        lambda: b.put_stream(bad, io.BytesIO(b"x")),
        lambda: b.put_file(bad, src),
        lambda: b.open_read(bad),
        lambda: b.get_file(bad, tmp_path / "dest"),
        lambda: b.stat(bad),
        lambda: b.delete(bad),
        lambda: b.delete_prefix(bad),
        lambda: b.stage(bad),
        lambda: b.is_published(bad, MARKER),
        lambda: b.is_published("ok", bad),
    ]
    if bad:
        ops.append(lambda: list(b.list(bad)))
    ops += [lambda: b.local_folder(bad, ["x"]).__enter__(), lambda: b.local_folder("ok", [bad]).__enter__()]
    for op in ops:
        with pytest.raises(InvalidKey):
            op()
    assert not tier.io_done()
    assert not (tmp_path / "dest").exists()


def test_a_staging_refuses_invalid_names(tier: Tier) -> None:
    st = tier.backend.stage("ckpt/s")
    for bad in ("../escape", "/abs", "", "a//b", "x/.ftd-staging"):
        with pytest.raises(InvalidKey):
            st.put_stream(bad, io.BytesIO(b"x"))
        with pytest.raises(InvalidKey):
            st.publish(bad, b"{}")
    assert not tier.backend.is_published("ckpt/s", MARKER)
    st.abort()


def test_publish_is_atomic_and_a_folder_is_never_reused(tier: Tier, tmp_path: Path) -> None:
    b = tier.backend
    src = tmp_path / "big.bin"
    src.write_bytes(blob(13 * MiB, seed=9))
    st = b.stage("job/step-1/rank-0")
    assert st.prefix == "job/step-1/rank-0"
    st.put_stream("meta.json", io.BytesIO(b'{"a": 1}'))
    st.put_file("shard/state.bin", src)

    assert not b.is_published("job/step-1/rank-0", MARKER)
    assert b.stat(f"job/step-1/rank-0/{MARKER}") is None
    if tier.hides_staged:
        assert list(b.list()) == []
        assert b.stat("job/step-1/rank-0/meta.json") is None

    st.publish(MARKER, b'{"shards": 1}')
    assert b.is_published("job/step-1/rank-0", MARKER)
    assert b.is_published("job/step-1/rank-0/", MARKER)
    assert not b.is_published("job/step-1/rank-0", "OTHER.json")
    assert [o.key for o in b.list("job/")] == [
        f"job/step-1/rank-0/{MARKER}", "job/step-1/rank-0/meta.json", "job/step-1/rank-0/shard/state.bin"]
    with b.open_read(f"job/step-1/rank-0/{MARKER}") as f:
        assert f.read() == b'{"shards": 1}'

    with pytest.raises(AlreadyPublished):
        st.publish(MARKER, b"again")
    with pytest.raises(AlreadyPublished):
        st.put_stream("late", io.BytesIO(b"x"))
    with pytest.raises(AlreadyPublished):  # raised by stage() or, at the latest, by publish()
        again = b.stage("job/step-1/rank-0")
        again.put_stream("meta.json", io.BytesIO(b"overwrite?"))
        again.publish(MARKER, b"second")
    with b.open_read(f"job/step-1/rank-0/{MARKER}") as f:
        assert f.read() == b'{"shards": 1}'
    with b.open_read("job/step-1/rank-0/meta.json") as f:
        assert f.read() == b'{"a": 1}'


def test_of_two_writers_staging_one_folder_only_the_first_publishes(tier: Tier) -> None:
    b = tier.backend
    first, second = b.stage("race/f"), b.stage("race/f")
    first.put_stream("a.bin", io.BytesIO(b"from first"))
    second.put_stream("b.bin", io.BytesIO(b"from second"))
    first.publish(MARKER, b"first")
    with pytest.raises(AlreadyPublished):
        second.publish(MARKER, b"second")
    second.abort()  # must not take the winner's folder with it
    assert b.is_published("race/f", MARKER)
    with b.open_read(f"race/f/{MARKER}") as f:
        assert f.read() == b"first"
    with b.open_read("race/f/a.bin") as f:
        assert f.read() == b"from first"


def test_abort_leaves_nothing_and_the_folder_can_be_staged_again(tier: Tier) -> None:
    b = tier.backend
    st = b.stage("job/step-2")
    st.put_stream("x", io.BytesIO(b"x"))
    st.put_stream("y/z", io.BytesIO(b"z"))
    st.abort()
    assert list(b.list()) == []
    assert not b.is_published("job/step-2", MARKER)
    with pytest.raises(StorageError, match="aborted"):
        st.put_stream("w", io.BytesIO(b"w"))

    again = b.stage("job/step-2")
    again.put_stream("x", io.BytesIO(b"x2"))
    again.publish(MARKER, b"{}")
    assert [o.key for o in b.list()] == [f"job/step-2/{MARKER}", "job/step-2/x"]


def test_cleanup_removes_an_abandoned_staging_but_never_a_published_folder(tier: Tier) -> None:
    b = tier.backend
    abandoned = b.stage("job/step-3")  # its writer "crashes": never published, never aborted
    abandoned.put_stream("half", io.BytesIO(b"half written"))
    done = b.stage("job/step-4")
    done.put_stream("whole", io.BytesIO(b"whole"))
    done.publish(MARKER, b"{}")
    b.put_stream("job/LATEST", io.BytesIO(b"step-4"))  # a plain object: not a staging, kept

    assert b.cleanup("job/", older_than_s=3600, marker_name=MARKER) == []  # too young to be abandoned
    removed = b.cleanup("job/", older_than_s=0, marker_name=MARKER)
    assert removed and all("step-3" in k for k in removed)
    assert [o.key for o in b.list()] == ["job/LATEST", f"job/step-4/{MARKER}", "job/step-4/whole"]
    assert b.is_published("job/step-4", MARKER)
    assert b.cleanup("job/", older_than_s=0, marker_name=MARKER) == []
    if tier.kind == "local":
        assert files_under(b.root) == ["job", "job/LATEST", "job/step-4", f"job/step-4/{MARKER}", "job/step-4/whole"]


def test_a_corrupted_object_fails_its_checksum_on_download(tier: Tier, tmp_path: Path) -> None:
    for key, size in (("small.bin", 4096), ("multi.bin", 12 * MiB + 3)):
        data = blob(size, seed=size)
        info = tier.backend.put_stream(key, io.BytesIO(data))
        tier.corrupt(key)
        dest = tmp_path / "dl" / key
        with pytest.raises(ChecksumMismatch) as err:
            tier.backend.get_file(key, dest)
        message = str(err.value)
        assert key in message and str(info.crc32c) in message
        assert crc32c_hex(bytes([data[0] ^ 0xFF]) + data[1:]) in message
        assert not dest.exists()
        assert os.listdir(dest.parent) == []  # the temp file is gone too


def test_a_progress_callback_that_raises_aborts_the_transfer(tier: Tier, tmp_path: Path) -> None:
    b = tier.backend
    data = blob(13 * MiB, seed=5)
    src = tmp_path / "src.bin"
    src.write_bytes(data)

    def stop(_: int) -> None:
        raise Interrupt

    with pytest.raises(Interrupt):
        b.put_file("f", src, progress=stop)
    with pytest.raises(Interrupt):
        b.put_stream("s", io.BytesIO(data), progress=stop)
    with pytest.raises(Interrupt):
        b.put_stream("small", io.BytesIO(b"tiny"), progress=stop)
    assert b.stat("f") is None and b.stat("s") is None and b.stat("small") is None
    assert list(b.list()) == []
    if tier.kind == "local":
        assert files_under(b.root) == []  # no temp files either

    b.put_stream("k", io.BytesIO(data))
    dest = tmp_path / "dl" / "k"
    with pytest.raises(Interrupt):
        b.get_file("k", dest, progress=stop)
    assert os.listdir(dest.parent) == []


def test_files_written_into_local_dir_are_committed_by_publish(tier: Tier) -> None:
    """A writer that needs paths (torch.save, DCP) writes files; the staging does the rest on any tier."""
    b = tier.backend
    data = blob(6 * MiB + 5, seed=21)  # larger than one S3 part: uploaded as a multipart upload
    st = b.stage("job/step-5/rank-0")
    d = st.local_dir()
    (d / "state.pt").write_bytes(data)
    (d / "sub").mkdir()
    (d / "sub" / "x.bin").write_bytes(b"x")
    st.put_stream("meta.json", io.BytesIO(b"{}"))
    assert [(o.key, o.size, o.crc32c) for o in st.objects()] == [
        ("meta.json", 2, crc32c_hex(b"{}")), ("state.pt", len(data), crc32c_hex(data)),
        ("sub/x.bin", 1, crc32c_hex(b"x"))]
    assert not b.is_published("job/step-5/rank-0", MARKER)
    if tier.hides_staged:
        assert list(b.list()) == []

    st.publish(MARKER, b'{"files": 3}')
    assert b.is_published("job/step-5/rank-0", MARKER)
    assert [o.key for o in b.list("job/")] == [f"job/step-5/rank-0/{n}" for n in (MARKER, "meta.json", "state.pt",
                                                                                  "sub/x.bin")]
    with b.open_read("job/step-5/rank-0/state.pt") as f:
        assert f.read() == data
    assert not d.exists()  # renamed into place, or uploaded and its spool removed
    with pytest.raises(AlreadyPublished):
        st.local_dir()


def test_abort_discards_files_written_into_local_dir(tier: Tier) -> None:
    b = tier.backend
    st = b.stage("job/step-6")
    d = st.local_dir()
    (d / "state.pt").write_bytes(b"half a checkpoint")
    st.abort()
    assert not d.exists() and list(b.list()) == []
    again = b.stage("job/step-6")
    (again.local_dir() / "state.pt").write_bytes(b"whole")
    again.publish(MARKER, b"{}")
    assert [o.key for o in b.list()] == [f"job/step-6/{MARKER}", "job/step-6/state.pt"]


def test_local_folder_hands_out_a_published_folders_files(tier: Tier) -> None:
    b = tier.backend
    data = blob(6 * MiB, seed=22)
    st = b.stage("job/step-7/rank-0")
    st.put_stream("state.pt", io.BytesIO(data))
    st.put_stream("sub/meta", io.BytesIO(b"m"))
    st.publish(MARKER, b"{}")
    with b.local_folder("job/step-7/rank-0", ["state.pt", "sub/meta"]) as d:
        assert (d / "state.pt").read_bytes() == data and (d / "sub" / "meta").read_bytes() == b"m"
    if tier.kind == "local":
        assert d == b.root / "job/step-7/rank-0"  # in place: no copy
    else:
        assert not d.exists()  # the download is removed on exit


def test_cleanup_with_select_leaves_other_writers_leftovers(tier: Tier) -> None:
    b = tier.backend
    for rank in (0, 1):  # two ranks' saves, both interrupted
        st = b.stage(f"job/step-8/rank-{rank}")
        st.put_stream("half", io.BytesIO(b"half"))
    removed = b.cleanup("job/", older_than_s=0, marker_name=MARKER, select=lambda key: key.startswith(
        "job/step-8/rank-1"))
    assert removed and all("rank-1" in k for k in removed)
    removed = b.cleanup("job/", older_than_s=0, marker_name=MARKER)
    assert removed and all("rank-0" in k for k in removed)
    assert list(b.list()) == []


# ---- the local tier only -------------------------------------------------------------------------


def test_local_disk_full_raises_storage_full_and_leaves_no_partial_files(tmp_path: Path) -> None:
    stack = contextlib.ExitStack()
    try:
        mnt = stack.enter_context(small_tmpfs(tmp_path / "small", size="2m"))
    except PermissionError as exc:
        pytest.skip(f"a 2 MiB tmpfs is needed to fill a disk: {exc}")
    with stack:
        b = LocalBackend(mnt / "tier")
        keep = blob(64 * 1024, seed=1)
        b.put_stream("keep/a", io.BytesIO(keep))
        before = files_under(mnt)

        with pytest.raises(StorageFull) as err:
            b.put_stream("big", io.BytesIO(blob(4 * MiB)))
        assert str(mnt / "tier" / "big") in str(err.value) and "no space left" in str(err.value)
        assert files_under(mnt) == before

        st = b.stage("ckpt")
        with pytest.raises(StorageFull):
            st.put_stream("big", io.BytesIO(blob(4 * MiB)))
        st.abort()
        assert files_under(mnt) == before
        assert b.get_file("keep/a", tmp_path / "keep").crc32c == crc32c_hex(keep)
        assert (tmp_path / "keep").read_bytes() == keep


def test_local_keys_cannot_escape_the_root_through_a_symlink(tmp_path: Path) -> None:
    root = tmp_path / "tier"
    root.mkdir()
    (tmp_path / "outside").mkdir()
    (root / "link").symlink_to(tmp_path / "outside")
    b = LocalBackend(root)
    with pytest.raises(InvalidKey, match="outside the tier root"):
        b.put_stream("link/x", io.BytesIO(b"x"))
    assert list((tmp_path / "outside").iterdir()) == []


def test_local_leftovers_are_hidden_from_list_and_removed_by_cleanup(tmp_path: Path) -> None:
    b = LocalBackend(tmp_path / "tier")
    b.put_stream("job/a", io.BytesIO(b"a"))
    tmp = tmp_path / "tier" / "job" / ".b.ftd-tmp-0123456789ab"
    tmp.write_bytes(b"partial")
    trash = tmp_path / "tier" / ".old.ftd-trash-0123456789ab"
    (trash / "sub").mkdir(parents=True)
    (trash / "sub" / "f").write_bytes(b"x")
    assert [o.key for o in b.list()] == ["job/a"]
    assert b.cleanup("", older_than_s=0) == [".old.ftd-trash-0123456789ab", "job/.b.ftd-tmp-0123456789ab"]
    assert files_under(tmp_path / "tier") == ["job", "job/a"]


def test_local_crc32c_is_unknown_without_the_xattr_and_then_not_verified(tmp_path: Path) -> None:
    b = LocalBackend(tmp_path / "tier")
    (tmp_path / "tier").mkdir()
    (tmp_path / "tier" / "plain").write_bytes(b"written by someone else")
    info = b.stat("plain")
    assert info is not None and info.crc32c is None
    assert b.get_file("plain", tmp_path / "out").crc32c == crc32c_hex(b"written by someone else")


# ---- the S3 tier only ------------------------------------------------------------------------------
