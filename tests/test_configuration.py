"""docs/configuration.md is the one list of MINFER_* settings: its table names exactly the
environment variables and CMake options the code reads, each one is exercised by some test,
and the settings without a test of their own elsewhere are checked here (read, validated)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "configuration.md"
NAME = re.compile(r"\bMINFER_[A-Z0-9_]*[A-Z0-9]\b")
# Compile-time names that cannot be set from outside (the doc lists them as "not settings").
INTERNAL = {"MINFER_HAS_CUDA", "MINFER_VEC_AVX2", "MINFER_Q_AVX2", "MINFER_Q_AVX512", "MINFER_Q_NEON",
            "MINFER_UNROLL", "MINFER_QROWS", "MINFER_FROWS"}
KINDS = {"user setting", "diagnostic", "build option", "build option (diagnostic)", "A/B switch, deletion requested"}


def doc_table() -> dict:
    """{name: kind} from the table's rows."""
    rows = {}
    for line in DOC.read_text().splitlines():
        m = re.match(r"\| `(MINFER_[A-Z0-9_]+)` \| ([^|]+) \|", line)
        if m:
            assert m.group(1) not in rows, f"{m.group(1)} twice in the table"
            rows[m.group(1)] = m.group(2).strip()
    return rows


def code_names() -> set:
    """MINFER_* names in the shipped code, the build, the CI script and the bench scripts."""
    files = subprocess.run(["git", "ls-files", "python", "csrc", "bench", "cmake", "CMakeLists.txt", "pyproject.toml",
                            ".ci"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    names = set()
    for f in files:
        p = ROOT / f
        if p.is_file() and p.suffix not in (".png", ".gguf"):
            names |= set(NAME.findall(p.read_text(errors="replace")))
    return names


def test_the_table_names_every_setting_the_code_reads():
    table = doc_table()
    assert table and set(table.values()) <= KINDS, set(table.values()) - KINDS
    found = code_names() - INTERNAL
    assert not found - set(table), f"read by the code, missing from docs/configuration.md: {sorted(found - set(table))}"
    assert not set(table) - found, f"in docs/configuration.md, read by no code: {sorted(set(table) - found)}"
    for name in INTERNAL:
        assert name in DOC.read_text(), f"{name}: the doc's list of internal names"


def test_every_setting_is_exercised_by_a_test():
    """A test sets, reads or checks each name (GPU tests count: they run on the GPU machine)."""
    text = {p.name: p.read_text() for p in (ROOT / "tests").glob("*.py") if p.name != Path(__file__).name}
    text[Path(__file__).name] = Path(__file__).read_text().rsplit("# -- the settings checked here", 1)[1]
    missing = [n for n in doc_table() if not any(re.search(rf"\b{n}\b", t) for t in text.values())]
    # Switches whose owners were asked to delete them (the doc's last rows) have no test of
    # their own; the day one is deleted its row goes and this list shrinks.
    pending = {n for n, k in doc_table().items() if k == "A/B switch, deletion requested"}
    assert set(missing) == pending, f"no test exercises {sorted(set(missing) - pending)}"


# -- the settings checked here -------------------------------------------------------------

def test_core_dir_loads_the_core_from_a_build_dir(tmp_path):
    """MINFER_CORE_DIR puts a build directory first on minfer's package path, so
    minfer._core comes from there; unset, from the installed package."""
    code = "import minfer, sys; sys.stdout.write(minfer.__path__[0])"
    env = {k: v for k, v in os.environ.items() if k != "MINFER_CORE_DIR"}
    plain = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert Path(plain).name == "minfer"
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**env, "MINFER_CORE_DIR": str(tmp_path)}).stdout
    assert got == str(tmp_path)


def test_trace_values_is_read_and_validated(monkeypatch):
    from minfer.errors import MinferError
    from minfer.tools.trace import DEFAULT_VALUES, Tracer

    monkeypatch.delenv("MINFER_TRACE_VALUES", raising=False)
    assert Tracer("m").max_values == DEFAULT_VALUES
    monkeypatch.setenv("MINFER_TRACE_VALUES", "3")
    assert Tracer("m").max_values == 3
    assert Tracer("m", max_values=5).max_values == 5  # an explicit value wins
    for bad in ("many", "-1"):
        monkeypatch.setenv("MINFER_TRACE_VALUES", bad)
        with pytest.raises(MinferError, match="MINFER_TRACE_VALUES"):
            Tracer("m")


def test_api_key_comes_from_the_environment(monkeypatch, tmp_path):
    """`minfer serve` takes its key from MINFER_API_KEY when --api-key is not given."""
    from typer.testing import CliRunner

    import minfer.model
    import minfer.server
    from minfer import cli

    seen = []
    monkeypatch.setattr(minfer.model.Model, "open", staticmethod(lambda *a, **k: object()))
    monkeypatch.setattr(minfer.server, "serve", lambda model, cfg: seen.append(cfg.api_key))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    runner = CliRunner()
    for env, args, want in (({"MINFER_API_KEY": "sekrit"}, [], "sekrit"), ({}, [], None),
                            ({"MINFER_API_KEY": "sekrit"}, ["--api-key", "other"], "other")):
        monkeypatch.delenv("MINFER_API_KEY", raising=False)
        r = runner.invoke(cli.app, ["serve", str(model), *args], env=env)
        assert r.exit_code == 0, r.output
        assert seen[-1] == want
