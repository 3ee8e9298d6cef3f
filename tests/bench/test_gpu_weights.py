"""``bench.gpu_weights``: split into chunks with a manifest, join with every sha256 checked - on small temporary
files, never the real GGUF (nothing here depends on what an earlier run left in ``.gpu_weights/``)."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from bench import gpu_weights
from bench.gpu_weights import CorruptChunkError, MissingChunkError, carry_plan, join, split


@pytest.fixture
def blob(tmp_path):
    """A 10,000-byte file of varied bytes (a chunk boundary that falls mid-pattern is caught by the hashes)."""
    path = tmp_path / "src" / "weights.gguf"
    path.parent.mkdir()
    path.write_bytes(bytes((i * 7 + i // 256) % 256 for i in range(10_000)))
    return path


def test_split_writes_equal_chunks_and_a_manifest_and_join_restores_the_file(tmp_path, blob):
    folder = tmp_path / "chunks"
    manifest = split(blob, folder, max_chunk_bytes=3_000)
    assert [c["size"] for c in manifest["chunks"]] == [2_500] * 4  # ceil(10000 / 3000) = 4 equal chunks
    assert [c["name"] for c in manifest["chunks"]] == [f"weights.gguf.part{i:03d}" for i in range(4)]
    data = blob.read_bytes()
    assert manifest["sha256"] == hashlib.sha256(data).hexdigest() == manifest["files"][0]["sha256"]
    for i, chunk in enumerate(manifest["chunks"]):
        assert chunk["sha256"] == hashlib.sha256(data[2_500 * i : 2_500 * (i + 1)]).hexdigest()
    assert json.loads((folder / "weights.gguf.manifest.json").read_text()) == manifest
    assert not (folder / "weights.gguf").exists()
    assert join(folder) == folder / "weights.gguf"
    assert (folder / "weights.gguf").read_bytes() == data


def test_join_is_idempotent(tmp_path, blob):
    folder = tmp_path / "chunks"
    split(blob, folder, max_chunk_bytes=4_096)
    out = join(folder, "weights.gguf")
    os.utime(out, ns=(1, 1))  # a rewrite would move the mtime
    for chunk in folder.glob("*.part*"):
        chunk.unlink()  # not even read when the assembled file verifies
    assert join(folder, "weights.gguf") == out and out.stat().st_mtime_ns == 1


def test_a_missing_chunk_is_named_and_nothing_is_written(tmp_path, blob):
    folder = tmp_path / "chunks"
    split(blob, folder, max_chunk_bytes=4_096)
    (folder / "weights.gguf.part001").unlink()
    with pytest.raises(MissingChunkError, match=r"1 of 3 chunks missing.*weights\.gguf\.part001"):
        join(folder)
    assert not (folder / "weights.gguf").exists()


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_corrupt_chunk_is_named_and_nothing_is_written(tmp_path, blob, damage):
    folder = tmp_path / "chunks"
    split(blob, folder, max_chunk_bytes=4_096)
    chunk = folder / "weights.gguf.part002"
    data = bytearray(chunk.read_bytes())
    if damage == "flip":
        data[17] ^= 1
    else:
        data = data[:-1]
    chunk.write_bytes(bytes(data))
    with pytest.raises(CorruptChunkError, match=r"weights\.gguf\.part002"):
        join(folder)
    assert not (folder / "weights.gguf").exists()


def test_a_corrupt_assembled_file_is_rebuilt_from_the_chunks(tmp_path, blob):
    folder = tmp_path / "chunks"
    split(blob, folder, max_chunk_bytes=4_096)
    (folder / "weights.gguf").write_bytes(b"stale" * 2_000)  # same size, wrong bytes
    assert join(folder).read_bytes() == blob.read_bytes()


def test_split_refuses_a_source_with_the_wrong_sha256(tmp_path, blob):
    folder = tmp_path / "chunks"
    with pytest.raises(CorruptChunkError, match="expected 00"):
        split(blob, folder, max_chunk_bytes=4_096, expected_sha256="00" * 32)
    assert not list(folder.iterdir())


def test_a_second_split_into_fewer_chunks_removes_the_stale_ones(tmp_path, blob):
    folder = tmp_path / "chunks"
    split(blob, folder, max_chunk_bytes=1_000)
    split(blob, folder, max_chunk_bytes=6_000)
    assert sorted(p.name for p in folder.glob("*.part*")) == ["weights.gguf.part000", "weights.gguf.part001"]
    assert join(folder).read_bytes() == blob.read_bytes()


def test_a_folder_round_trips_file_by_file(tmp_path):
    head = tmp_path / "eagle3_head"
    (head / "sub").mkdir(parents=True)
    files = {"config.json": b'{"a": 1}', "model.safetensors": os.urandom(5_000), "sub/x.bin": b""}
    for rel, data in files.items():
        (head / rel).write_bytes(data)
    folder = tmp_path / "chunks"
    manifest = split(head, folder, max_chunk_bytes=2_000)
    assert manifest["kind"] == "folder" and len(manifest["chunks"]) == 3
    assert [f["path"] for f in manifest["files"]] == ["eagle3_head/config.json", "eagle3_head/model.safetensors",
                                                      "eagle3_head/sub/x.bin"]  # fmt: skip
    out = join(folder, "eagle3_head")
    assert out == folder / "eagle3_head"
    assert {rel: (out / rel).read_bytes() for rel in files} == files


def test_carry_plan_puts_the_manifest_first_and_packs_chunks_under_the_call_limit(tmp_path, blob, monkeypatch):
    folder = tmp_path / "repo" / ".gpu_weights"
    monkeypatch.setattr(gpu_weights, "REPO", tmp_path / "repo")
    split(blob, folder, max_chunk_bytes=3_000)  # 4 chunks of 2,500 bytes
    calls = carry_plan(folder, call_bytes=5_000)
    assert calls == [[".whl", ".gpu_weights/weights.gguf.manifest.json", ".gpu_weights/weights.gguf.part000",
                      ".gpu_weights/weights.gguf.part001"],
                     [".whl", ".gpu_weights/weights.gguf.part002", ".gpu_weights/weights.gguf.part003"]]  # fmt: skip
    with pytest.raises(ValueError, match="larger than a call"):
        carry_plan(folder, call_bytes=2_000)


def test_the_command_line_reports_a_missing_chunk_and_exits_2(tmp_path, blob, capsys):
    folder = tmp_path / "chunks"
    assert gpu_weights.main(["split", str(blob), "--dir", str(folder), "--max-chunk-mib", str(4_096 / 2**20)]) == 0
    assert "3 chunks" in capsys.readouterr().out
    (folder / "weights.gguf.part000").unlink()
    assert gpu_weights.main(["status", "--dir", str(folder)]) == 0
    assert "2/3 chunks present" in capsys.readouterr().out
    assert gpu_weights.main(["join", "--dir", str(folder)]) == 2
    assert "weights.gguf.part000" in capsys.readouterr().err
