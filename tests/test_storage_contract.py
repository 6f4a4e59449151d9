"""One contract suite for the storage tiers, run against the local-directory tier, the memory tier
(a directory tier with a budget and a keep rule: the same contract) and the S3 tier talking HTTP to
moto's standalone server; then what only one of them can show (multipart resume, retries, an
unreachable endpoint; a full disk, symlinks)."""

from __future__ import annotations

import contextlib
import io
import os
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError, ResponseStreamingError
from storage_fixtures import MotoServer, RegionCheckingProxy, small_tmpfs

from ftd.ftctl.etcd_server import free_port
from ftd.storage_backends.base import (
    AlreadyPublished,
    ChecksumMismatch,
    InvalidKey,
    ObjectNotFound,
    StorageError,
    StorageFull,
    StorageUnavailable,
    crc32c_hex,
    is_reserved,
)
from ftd.storage_backends.local import LocalBackend
from ftd.storage_backends.memory import MemoryTier
from ftd.storage_backends.s3 import PENDING, S3Backend, crc_b64
from ftd.storage_backends.tiers import S3Spec, TierSpec, open_backend

MiB = 1 << 20
PART = 5 * MiB  # the S3 tier's part size here: S3's minimum, so 13-28 MiB objects are multipart
MARKER = "SHARD.json"


class Interrupt(Exception):
    """Raised by a progress callback to cut a transfer short."""


def blob(size: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(size)


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


@pytest.fixture(scope="module")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    server = MotoServer(tmp_path_factory.mktemp("moto") / "moto.log").start()
    try:
        yield server
    finally:
        server.stop()


def s3_backend(moto: MotoServer, tmp_path: Path, **kw: Any) -> S3Backend:
    return S3Backend(moto.new_bucket(), prefix="tier", endpoint_url=moto.endpoint, part_size=PART,
                     state_dir=tmp_path / "uploads", client=moto.client(), **kw)


def count_sends(backend: S3Backend) -> list[str]:
    """The HTTP requests the backend's client sends, as 'METHOD url'."""
    sent: list[str] = []
    backend.client.meta.events.register("before-send.s3", lambda request, **_: sent.append(
        f"{request.method} {request.url}"))
    return sent


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


@pytest.mark.s3
def test_an_s3_tier_opened_from_its_spec_signs_for_its_region(moto: MotoServer, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    proxy = RegionCheckingProxy(moto.port, "eu-west-2").start()
    try:
        spec = S3Spec(endpoint=proxy.endpoint, bucket=moto.new_bucket("eu-west-2"), region="eu-west-2",
                      part_size=PART, state_dir=tmp_path / "uploads", max_attempts=1)
        b = open_backend(TierSpec("s3", "s3", spec))
        data = blob(11 * MiB, seed=23)
        st = b.stage("f")
        (st.local_dir() / "state.pt").write_bytes(data)  # a multipart upload at publish
        st.publish(MARKER, b"{}")
        with b.local_folder("f", ["state.pt"]) as d:
            assert (d / "state.pt").read_bytes() == data
        assert [o.key for o in b.list()] == [f"f/{MARKER}", "f/state.pt"] and proxy.refused == []

        elsewhere = open_backend(TierSpec("s3", "s3", replace(spec, region="us-east-1")))
        with pytest.raises(StorageError, match="AuthorizationHeaderMalformed"):
            elsewhere.get_file("f/state.pt", tmp_path / "elsewhere")
        assert proxy.refused and not (tmp_path / "elsewhere").exists()
    finally:
        proxy.stop()


@pytest.mark.s3
def test_s3_local_folder_verifies_every_download(moto: MotoServer, tmp_path: Path) -> None:
    b = s3_backend(moto, tmp_path)
    st = b.stage("f")
    st.put_stream("good", io.BytesIO(b"good bytes"))
    st.put_stream("bad", io.BytesIO(b"bad bytes"))
    st.publish(MARKER, b"{}")
    raw = moto.client()
    obj = raw.get_object(Bucket=b.bucket, Key="tier/f/bad")
    raw.put_object(Bucket=b.bucket, Key="tier/f/bad", Body=b"BAD bytes", Metadata=obj["Metadata"])
    with pytest.raises(ChecksumMismatch, match="f/bad"), b.local_folder("f", ["good", "bad"]):
        pass
    with pytest.raises(ObjectNotFound), b.local_folder("f", ["missing"]):
        pass
    assert [p.name for p in (tmp_path / "uploads").iterdir() if ".ftd-restore-" in p.name] == []


def calls(backend: S3Backend, op: str) -> list[dict[str, Any]]:
    """The parameters of every ``op`` call (each attempt) the backend's client makes."""
    seen: list[dict[str, Any]] = []
    backend.client.meta.events.register(f"provide-client-params.s3.{op}", lambda params, **_: seen.append(dict(params)))
    return seen


def fail_first(backend: S3Backend, op: str, errors: list[Exception]) -> list[int]:
    """Makes the next ``len(errors)`` ``op`` calls raise those errors; returns the attempt counter."""
    attempts = [0]

    def inject(**_: Any) -> None:
        attempts[0] += 1
        if errors:
            raise errors.pop(0)

    backend.client.meta.events.register(f"before-call.s3.{op}", inject)
    return attempts


def _interrupt_after(limit: int) -> Callable[[int], None]:
    moved = [0]

    def progress(n: int) -> None:
        moved[0] += n
        if moved[0] >= limit:
            raise Interrupt

    return progress


@pytest.mark.s3
def test_parts_carry_their_crc32c_and_the_object_its_whole_crc32c(moto: MotoServer, tmp_path: Path) -> None:
    b = s3_backend(moto, tmp_path)
    data = blob(13 * MiB, seed=11)
    created, parts = calls(b, "CreateMultipartUpload"), calls(b, "UploadPart")
    b.put_stream("obj", io.BytesIO(data))
    assert created[0]["Metadata"] == {"ftd-crc32c": crc32c_hex(data)}
    assert created[0]["ChecksumAlgorithm"] == "CRC32C"
    assert sorted(p["PartNumber"] for p in parts) == [1, 2, 3]
    for p in parts:
        n = p["PartNumber"]
        assert p["ChecksumCRC32C"] == crc_b64(crc32c_hex(data[(n - 1) * PART: n * PART]))
    # ... and they go out on the wire as the header S3 verifies
    headers: list[dict[str, Any]] = []
    b.client.meta.events.register("before-send.s3", lambda request, **_: headers.append(dict(request.headers)))
    b.put_stream("obj2", io.BytesIO(data))
    sent = sorted(h["x-amz-checksum-crc32c"] for h in headers if "x-amz-checksum-crc32c" in h)
    assert sent == sorted(crc_b64(crc32c_hex(data[i: i + PART])).encode() for i in range(0, len(data), PART))
    head = moto.client().head_object(Bucket=b.bucket, Key="tier/obj")
    assert head["Metadata"]["ftd-crc32c"] == crc32c_hex(data) and head["ContentLength"] == len(data)


@pytest.mark.s3
def test_md5_part_checksums_for_stores_without_flexible_checksums(moto: MotoServer, tmp_path: Path) -> None:
    b = s3_backend(moto, tmp_path, part_checksum="md5")
    data = blob(11 * MiB, seed=12)
    parts = calls(b, "UploadPart")
    assert b.put_stream("obj", io.BytesIO(data)).crc32c == crc32c_hex(data)
    assert parts and all("ContentMD5" in p and "ChecksumCRC32C" not in p for p in parts)
    assert b.get_file("obj", tmp_path / "back").crc32c == crc32c_hex(data)


@pytest.mark.s3
def test_an_interrupted_multipart_upload_resumes_without_resending_parts(moto: MotoServer, tmp_path: Path) -> None:
    b = s3_backend(moto, tmp_path, concurrency=1)
    raw = moto.client()
    data = blob(28 * MiB, seed=13)  # 6 parts
    src = tmp_path / "shard.bin"
    src.write_bytes(data)
    sent = calls(b, "UploadPart")

    with pytest.raises(Interrupt):
        b.put_file("ckpt/shard.bin", src, progress=_interrupt_after(2 * PART))
    assert b.stat("ckpt/shard.bin") is None
    (upload,) = raw.list_multipart_uploads(Bucket=b.bucket)["Uploads"]
    stored = {p["PartNumber"] for p in raw.list_parts(Bucket=b.bucket, Key=upload["Key"],
                                                      UploadId=upload["UploadId"])["Parts"]}
    assert 2 <= len(stored) < 6
    (journal,) = (tmp_path / "uploads").glob("*.json")
    assert str(upload["UploadId"]) in journal.read_text()

    sent.clear()
    info = b.put_file("ckpt/shard.bin", src)
    assert sorted(p["PartNumber"] for p in sent) == sorted(set(range(1, 7)) - stored)
    assert all(p["UploadId"] == upload["UploadId"] for p in sent)
    assert info.crc32c == crc32c_hex(data)
    assert raw.list_multipart_uploads(Bucket=b.bucket).get("Uploads", []) == []
    assert not journal.exists()
    b.get_file("ckpt/shard.bin", tmp_path / "back.bin")
    assert (tmp_path / "back.bin").read_bytes() == data


@pytest.mark.s3
def test_a_resume_starts_over_when_the_upload_is_gone(moto: MotoServer, tmp_path: Path) -> None:
    b = s3_backend(moto, tmp_path, concurrency=1)
    raw = moto.client()
    data = blob(16 * MiB, seed=14)  # 4 parts
    src = tmp_path / "shard.bin"
    src.write_bytes(data)
    with pytest.raises(Interrupt):
        b.put_file("shard.bin", src, progress=_interrupt_after(PART))
    (upload,) = raw.list_multipart_uploads(Bucket=b.bucket)["Uploads"]
    raw.abort_multipart_upload(Bucket=b.bucket, Key=upload["Key"], UploadId=upload["UploadId"])

    sent = calls(b, "UploadPart")
    assert b.put_file("shard.bin", src).crc32c == crc32c_hex(data)
    assert sorted(p["PartNumber"] for p in sent) == [1, 2, 3, 4]
    assert b.get_file("shard.bin", tmp_path / "back").crc32c == crc32c_hex(data)


@pytest.mark.s3
def test_cleanup_aborts_an_abandoned_multipart_upload(moto: MotoServer, tmp_path: Path) -> None:
    b = s3_backend(moto, tmp_path)
    raw = moto.client()
    src = tmp_path / "shard.bin"
    src.write_bytes(blob(13 * MiB, seed=15))
    with pytest.raises(Interrupt):
        b.put_file("job/step-9/shard.bin", src, progress=_interrupt_after(1))
    assert len(raw.list_multipart_uploads(Bucket=b.bucket)["Uploads"]) == 1
    assert b.cleanup("other/", older_than_s=0) == []  # not under that prefix
    assert b.cleanup("job/", older_than_s=0) == ["job/step-9/shard.bin"]
    assert raw.list_multipart_uploads(Bucket=b.bucket).get("Uploads", []) == []


@pytest.mark.s3
def test_cleanup_finishes_an_interrupted_publish_and_an_interrupted_delete(moto: MotoServer, tmp_path: Path) -> None:
    b = s3_backend(moto, tmp_path)
    raw = moto.client()
    st = b.stage("f")
    st.put_stream("x", io.BytesIO(b"x"))
    st.publish(MARKER, b"{}")
    # a crash right after the marker: the pending object, naming the marker, is still there
    raw.put_object(Bucket=b.bucket, Key=f"tier/f/{PENDING}", Body=b'{"marker": "SHARD.json"}')
    with pytest.raises(AlreadyPublished):
        b.stage("f")
    assert b.cleanup("", older_than_s=0) == [f"f/{PENDING}"]  # default marker name: the record names it
    assert [o.key for o in b.list()] == [f"f/{MARKER}", "f/x"]

    # a delete that stopped after the marker: cleanup deletes the rest
    raw.put_object(Bucket=b.bucket, Key=f"tier/f/{PENDING}", Body=b'{"deleting": true}')
    raw.delete_object(Bucket=b.bucket, Key=f"tier/f/{MARKER}")
    assert b.cleanup("", older_than_s=0, marker_name=MARKER) == [f"f/{PENDING}", "f/x"]
    assert list(b.list()) == []


@pytest.mark.s3
def test_a_restarted_writer_can_stage_its_unpublished_folder_again(moto: MotoServer, tmp_path: Path) -> None:
    b = s3_backend(moto, tmp_path)
    crashed = b.stage("f")
    crashed.put_stream("a", io.BytesIO(b"a"))
    again = b.stage("f")  # the pending object says: unpublished, so the folder may be resumed
    again.put_stream("b", io.BytesIO(b"b"))
    again.publish(MARKER, b"{}")
    assert [o.key for o in b.list()] == [f"f/{MARKER}", "f/a", "f/b"]


@pytest.mark.s3
def test_an_unreachable_endpoint_raises_storage_unavailable_after_bounded_attempts(tmp_path: Path) -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    b = S3Backend("bucket", endpoint_url=endpoint, max_attempts=2, backoff_s=0.05, state_dir=tmp_path,
                  aws_access_key_id="testing", aws_secret_access_key="testing")
    sent = count_sends(b)
    with pytest.raises(StorageUnavailable) as err:
        b.stat("some/key")
    assert endpoint in str(err.value) and "some/key" in str(err.value) and "bucket" in str(err.value)
    assert "2 attempts" in str(err.value)
    assert isinstance(err.value.__cause__, EndpointConnectionError)
    assert len(sent) == 2
    with pytest.raises(StorageUnavailable):
        b.put_stream("k", io.BytesIO(b"x"))


@pytest.mark.s3
def test_transient_errors_are_retried_and_then_succeed(moto: MotoServer, tmp_path: Path) -> None:
    b = s3_backend(moto, tmp_path, max_attempts=3, backoff_s=0.01)
    slow_down = ClientError({"Error": {"Code": "SlowDown", "Message": "reduce your rate"},
                             "ResponseMetadata": {"HTTPStatusCode": 503}}, "PutObject")
    attempts = fail_first(b, "PutObject", [EndpointConnectionError(endpoint_url=moto.endpoint), slow_down])
    b.put_stream("k", io.BytesIO(b"payload"))
    assert attempts[0] == 3
    with b.open_read("k") as f:
        assert f.read() == b"payload"


class _BodyThatBreaks:
    """A GetObject body whose connection drops after ``after`` bytes."""

    def __init__(self, body: Any, after: int) -> None:
        self.body, self.after = body, after

    def iter_chunks(self, size: int) -> Iterator[bytes]:
        sent = 0
        for chunk in self.body.iter_chunks(min(size, self.after)):
            if sent + len(chunk) > self.after:
                raise ResponseStreamingError(error="connection reset by peer (injected)")
            sent += len(chunk)
            yield chunk

    def close(self) -> None:
        self.body.close()


@pytest.mark.s3
def test_a_download_cut_mid_stream_resumes_where_it_stopped(moto: MotoServer, tmp_path: Path) -> None:
    b = s3_backend(moto, tmp_path, backoff_s=0.01)
    data = blob(9 * MiB, seed=16)
    b.put_stream("k", io.BytesIO(data))
    breaks = [3 * MiB]

    def break_once(parsed: dict[str, Any], **_: Any) -> None:
        if breaks:
            parsed["Body"] = _BodyThatBreaks(parsed["Body"], breaks.pop())

    b.client.meta.events.register("after-call.s3.GetObject", break_once)
    gets = calls(b, "GetObject")
    moved: list[int] = []
    assert b.get_file("k", tmp_path / "k", progress=moved.append).crc32c == crc32c_hex(data)
    assert (tmp_path / "k").read_bytes() == data
    assert sum(moved) == len(data)
    assert len(gets) == 2 and "Range" not in gets[0]
    assert gets[1]["Range"] == f"bytes={3 * MiB}-" and gets[1]["IfMatch"]


@pytest.mark.s3
def test_refusals_are_not_retried(moto: MotoServer, tmp_path: Path) -> None:
    b = s3_backend(moto, tmp_path, max_attempts=5, backoff_s=0.01)
    denied = ClientError({"Error": {"Code": "AccessDenied", "Message": "no"},
                          "ResponseMetadata": {"HTTPStatusCode": 403}}, "HeadObject")
    attempts = fail_first(b, "HeadObject", [denied])
    with pytest.raises(StorageError, match="AccessDenied") as err:
        b.stat("k")
    assert not isinstance(err.value, StorageUnavailable)
    assert attempts[0] == 1


@pytest.mark.s3
def test_a_quota_error_is_storage_full(moto: MotoServer, tmp_path: Path) -> None:
    b = s3_backend(moto, tmp_path)
    quota = ClientError({"Error": {"Code": "QuotaExceeded", "Message": "bucket quota"},
                         "ResponseMetadata": {"HTTPStatusCode": 403}}, "PutObject")
    fail_first(b, "PutObject", [quota])
    with pytest.raises(StorageFull, match="QuotaExceeded"):
        b.put_stream("k", io.BytesIO(b"x"))


@pytest.mark.s3
def test_create_multipart_upload_is_never_retried(moto: MotoServer, tmp_path: Path) -> None:
    b = s3_backend(moto, tmp_path, max_attempts=5, backoff_s=0.01)
    attempts = fail_first(b, "CreateMultipartUpload", [EndpointConnectionError(endpoint_url=moto.endpoint)])
    src = tmp_path / "big"
    src.write_bytes(blob(11 * MiB))
    with pytest.raises(StorageUnavailable, match="CreateMultipartUpload"):
        b.put_file("big", src)
    assert attempts[0] == 1
    assert moto.client().list_multipart_uploads(Bucket=b.bucket).get("Uploads", []) == []
    assert b.put_file("big", src).size == 11 * MiB  # the next put starts clean


@pytest.mark.s3
def test_the_marker_is_written_create_only(moto: MotoServer, tmp_path: Path) -> None:
    b = s3_backend(moto, tmp_path)
    st = b.stage("f")
    marker_puts = calls(b, "PutObject")
    st.publish(MARKER, b"{}")
    (put,) = [p for p in marker_puts if p["Key"].endswith(MARKER)]
    assert put["IfNoneMatch"] == "*"
