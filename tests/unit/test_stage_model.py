"""benchmarks/stage_model.py: the GGUF split into capped parts and rebuilt bit for bit, every
missing or damaged part named, and ``unpack`` handing the rebuilt file to
``sglang_prr.tools.models.smollm2_path`` (no download, no conversion here)."""

from __future__ import annotations

import json
import os

import pytest

import bench_module


@pytest.fixture(scope="module")
def stage():
    return bench_module.load("stage_model")


@pytest.fixture
def gguf(tmp_path, seed):
    path = tmp_path / "src" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    path.parent.mkdir()
    path.write_bytes(os.urandom(10_000 + seed % 997))
    return path


def test_split_and_join_round_trip(stage, gguf, tmp_path):
    parts = tmp_path / "parts"
    man = stage.split(gguf, parts, 4096)
    sizes = [p["bytes"] for p in man["parts"]]
    assert len(sizes) == 3 and sizes[:2] == [4096, 4096] and sum(sizes) == gguf.stat().st_size
    assert sorted(p.name for p in parts.iterdir()) == ["manifest.json", "part-00", "part-01",
                                                       "part-02"]
    assert json.loads((parts / "manifest.json").read_text())["sha256"] == stage.sha256(gguf)
    assert stage.check_parts(parts) == []
    (tmp_path / "out").mkdir()
    out = stage.join(parts, tmp_path / "out")
    assert out.name == gguf.name and out.read_bytes() == gguf.read_bytes()
    # a second split into the same folder leaves no stale part behind
    stage.split(gguf, parts, 8192)
    assert sorted(p.name for p in parts.glob("part-*")) == ["part-00", "part-01"]


def test_missing_and_damaged_parts_are_named(stage, gguf, tmp_path):
    parts = tmp_path / "parts"
    stage.split(gguf, parts, 4096)
    (parts / "part-01").unlink()
    data = bytearray((parts / "part-02").read_bytes())
    data[7] ^= 0xFF  # same size, one byte flipped
    (parts / "part-02").write_bytes(bytes(data))
    problems = stage.check_parts(parts)
    assert problems == ["part-01 missing",
                        "part-02 is damaged (SHA-256 differs from the manifest)"]
    with pytest.raises(ValueError, match="part-01 missing"):
        stage.join(parts, tmp_path)
    (parts / "part-00").write_bytes(b"short")
    assert "part-00 has 5 bytes, expected 4096" in stage.check_parts(parts)[0]
    (parts / "manifest.json").unlink()
    assert "no manifest.json" in stage.check_parts(parts)[0]


def test_whole_file_checksum(stage, gguf, tmp_path):
    parts = tmp_path / "parts"
    stage.split(gguf, parts, 4096)
    man = json.loads((parts / "manifest.json").read_text())
    man["sha256"] = "0" * 64  # parts intact, whole file not what was packed
    (parts / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(ValueError, match="does not match"):
        stage.join(parts, tmp_path)


def test_unpack_hands_the_rebuilt_gguf_to_models(stage, gguf, tmp_path, monkeypatch):
    parts = tmp_path / "parts"
    stage.split(gguf, parts, 4096)
    seen = {}

    def fake_smollm2_path(download):
        d = tmp_path / "dl"
        d.mkdir()
        got = download(d)
        seen["bytes"] = got.read_bytes()
        return "/models/smollm2"

    monkeypatch.setattr(stage.models, "is_cached", lambda path=None: False)
    monkeypatch.setattr(stage.models, "smollm2_path", fake_smollm2_path)
    assert stage.unpack(parts) == "/models/smollm2"
    assert seen["bytes"] == gguf.read_bytes()
    # negative control: a missing part stops before the conversion is called
    seen.clear()
    (parts / "part-00").unlink()
    with pytest.raises(ValueError, match="part-00 missing"):
        stage.unpack(parts)
    assert not seen
    assert stage.main(["unpack", "--dir", str(parts)]) == 1


def test_cli_pack_prints_what_each_call_carries(stage, gguf, tmp_path, capsys):
    assert stage.main(["pack", "--gguf", str(gguf), "--dir", str(tmp_path / "p"),
                       "--part-mib", str(4096 / (1 << 20))]) == 0
    out = capsys.readouterr().out
    calls = [ln for ln in out.splitlines() if ln.strip().startswith("call ")]
    assert len(calls) == 3 and "part-02" in calls[2] and calls[2].endswith("unpack")
    assert all("manifest.json" in c for c in calls) and calls[0].endswith("status")
    with pytest.raises(SystemExit):
        stage.main(["pack", "--part-mib", "0"])
    assert "--part-mib 0" in capsys.readouterr().err
