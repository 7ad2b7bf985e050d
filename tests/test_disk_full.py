"""A full disk, for real: the server's data directory on a small tmpfs, filled to the last byte.
An ingest answers 507 naming the full disk and what the document needs, loses nothing and leaves no
index.tmp; a DELETE still succeeds (the reserve is released for it); ingests work again once there is
room; start-up warns that the disk is smaller than store.max_disk_bytes assumes. Needs `mount` (root):
skips, printing why, where a tmpfs cannot be mounted."""

from __future__ import annotations

import errno
import logging
import subprocess

import httpx
import pytest

from app.documents.storage import check_free_space
from app.testing import LiveServer
from configs.settings import load_settings

TEXT = " ".join(f"Sentence {i} of a document about lighthouses and their keepers." for i in range(200))


@pytest.fixture
def small_disk(tmp_path):
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mount_point)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        reason = f"cannot mount a tmpfs here: {mounted.stderr.strip() or mounted.returncode}"
        print(f"\nSKIP disk-full tests: {reason}")
        pytest.skip(reason)
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def fill(path) -> None:
    """Write until the disk refuses one more byte."""
    with open(path, "ab", buffering=0) as filler:
        for size in (1 << 20, 1 << 12, 1):
            try:
                while True:
                    filler.write(b"\0" * size)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc


def test_a_full_disk_is_a_507_and_a_delete_still_frees_space(small_disk, caplog):
    data_dir = small_disk / "data"
    settings = load_settings(data_dir=data_dir, model={"name": "random:tiny-llama", "device": "cpu"},
                             store={"max_memory_bytes": 0, "disk_reserve_bytes": 2 << 20})
    with caplog.at_level(logging.WARNING), LiveServer(settings) as server, \
            httpx.Client(base_url=server.url, timeout=120) as http:
        assert "store.max_disk_bytes lets the KV store grow" in caplog.text  # 20 GB bound on a 24 MB disk
        assert http.post("/v1/documents", json={"documents": [{"id": "keep", "text": TEXT}]}).status_code == 201
        fill(small_disk / "filler")

        refused = http.post("/v1/documents", json={"documents": [{"id": "more", "text": TEXT + " more"}]})
        assert refused.status_code == 507, refused.text
        error = refused.json()["error"]
        assert error["type"] == "insufficient_storage"
        assert str(small_disk) in error["message"] and "is full" in error["message"], error["message"]
        assert "MB more" in error["message"] and "Nothing was lost" in error["message"]
        assert "OSError" not in error["message"]
        upload = http.post("/v1/documents/files", files=[("files", ("more.txt", (TEXT + " upload").encode()))])
        assert upload.status_code == 507, upload.text
        assert not (data_dir / "index.tmp").exists()
        assert http.get("/v1/documents/keep").status_code == 200 and http.get("/v1/documents/more").status_code == 404

        fill(small_disk / "filler")  # to the last byte again, whatever the refused writes left
        deleted = http.delete("/v1/documents/keep")
        assert deleted.status_code == 200, deleted.text
        assert http.get("/v1/documents/keep").status_code == 404

        (small_disk / "filler").unlink()
        assert http.post("/v1/documents", json={"documents": [{"id": "more", "text": TEXT}]}).status_code == 201
        assert (data_dir / "reserve.bin").stat().st_size == 2 << 20  # taken back for the next full disk
    restarted = load_settings(data_dir=data_dir, model={"name": "random:tiny-llama", "device": "cpu"},
                              store={"max_memory_bytes": 0, "disk_reserve_bytes": 2 << 20})
    with LiveServer(restarted) as server, httpx.Client(base_url=server.url, timeout=120) as http:
        assert [d["id"] for d in http.get("/v1/documents").json()["documents"]] == ["more"]


def test_start_up_warns_when_the_disk_is_smaller_than_the_bounds(tmp_path):
    huge = load_settings(data_dir=tmp_path, store={"max_disk_bytes": 1 << 60})
    warning = check_free_space(huge, kv_bytes_used=0)
    assert warning is not None and str(tmp_path / "kv") in warning and "store.max_disk_bytes" in warning
    assert check_free_space(load_settings(data_dir=tmp_path, store={"max_disk_bytes": 1 << 20}), 0) is None
