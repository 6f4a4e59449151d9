"""What only the S3 tier can show, against moto's standalone server over HTTP: region signing, part and
object checksums, multipart resume, retries of idempotent calls only, an unreachable endpoint, a download
cut mid-stream, create-only markers (the contract all tiers share: test_storage_contract.py)."""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError, ResponseStreamingError
from storage_fixtures import (
    MARKER,
    PART,
    Interrupt,
    MiB,
    MotoServer,
    RegionCheckingProxy,
    blob,
    count_sends,
    s3_backend,
)

from ftd.ftctl.etcd_server import free_port
from ftd.storage_backends.base import (
    AlreadyPublished,
    ChecksumMismatch,
    ObjectNotFound,
    StorageError,
    StorageFull,
    StorageUnavailable,
    crc32c_hex,
)
from ftd.storage_backends.s3 import PENDING, S3Backend, crc_b64
from ftd.storage_backends.tiers import S3Spec, TierSpec, open_backend


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
