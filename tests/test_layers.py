"""The layering contract (pyproject.toml [tool.importlinter]) holds, and can fail.

cli > api > server, tools > session/model > engine > rows > models | backends > graph >
tokenizer/io:
a layer imports only the layers below it, models and backends are independent,
the graph imports neither backends, models nor the compiled core, no sibling cycles.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import minfer

REPO = Path(__file__).resolve().parent.parent
PKG = Path(minfer.__file__).resolve().parent
FORBIDDEN_IN_GRAPH = ("minfer._core", "minfer.backends", "minfer.models")


def lint(config: Path, cwd: Path, pythonpath: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    code = ("import sys; from importlinter.cli import lint_imports; "
            f"sys.exit(lint_imports(config_filename={str(config)!r}, no_cache=True))")
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def test_minfer_keeps_its_import_contract():
    r = lint(REPO / "pyproject.toml", REPO)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 broken" in r.stdout and "KEPT" in r.stdout


# -- the contract is not vacuous: the same contract text over a toy package -------------

# Every non-optional module the contract names, as an empty module of the toy package.
TOY_MODULES = ["cli", "api", "server", "tools", "session", "model", "engine", "rows", "models", "backends", "graph",
               "tokenizer", "chat", "io"]


def toy_config(tmp_path: Path) -> Path:
    """Our [tool.importlinter] section with 'minfer' renamed to 'toypkg'."""
    conf = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]

    def rename(v):
        if isinstance(v, str):
            return v.replace("minfer", "toypkg")
        if isinstance(v, list):
            return [rename(x) for x in v]
        if isinstance(v, dict):
            return {k: rename(x) for k, x in v.items()}
        return v

    conf = rename(conf)
    lines = ["[tool.importlinter]"]
    for k, v in conf.items():
        if k != "contracts":
            lines.append(f"{k} = {_toml(v)}")
    for c in conf["contracts"]:
        lines.append("[[tool.importlinter.contracts]]")
        lines += [f"{k} = {_toml(v)}" for k, v in c.items()]
    path = tmp_path / "contract.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _toml(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    return repr(v) if isinstance(v, int) else '"' + str(v).replace('"', '\\"') + '"'


def toy_package(tmp_path: Path, imports: list) -> Path:
    root = tmp_path / "src"
    pkg = root / "toypkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    body = {m: "" for m in TOY_MODULES}
    for importer, imported in imports:
        body[importer] += f"import toypkg.{imported}\n"
    for m, text in body.items():
        (pkg / m).mkdir()
        (pkg / m / "__init__.py").write_text(text)
    return root


def test_toy_package_with_allowed_imports_keeps_the_contract(tmp_path):
    allowed = [("cli", "tools"), ("cli", "server"), ("server", "session"), ("tools", "session"),
               ("session", "model"), ("session", "backends"), ("model", "models"),
               ("backends", "graph"), ("models", "graph"), ("graph", "io"), ("tokenizer", "io")]
    root = toy_package(tmp_path, allowed)
    r = lint(toy_config(tmp_path), tmp_path, str(root))
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("bad", [
    ("graph", "backends"),       # the import cycle issue 8 removed
    ("graph", "models"),
    ("models", "backends"),      # models and backends are independent
    ("backends", "models"),
    ("io", "graph"),             # upward
    ("backends", "session"),
    ("session", "tools"),
    ("model", "server"),
    ("graph", "cli"),
])
def test_a_bad_import_breaks_the_contract(tmp_path, bad):
    root = toy_package(tmp_path, [bad])
    r = lint(toy_config(tmp_path), tmp_path, str(root))
    assert r.returncode != 0, r.stdout
    assert "BROKEN" in r.stdout and f"toypkg.{bad[0]}" in r.stdout


def test_a_sibling_cycle_breaks_the_contract(tmp_path):
    root = toy_package(tmp_path, [("tokenizer", "chat"), ("chat", "tokenizer")])
    r = lint(toy_config(tmp_path), tmp_path, str(root))
    assert r.returncode != 0 and "No cycles are allowed" in r.stdout, r.stdout


# -- the compiled core, which the import graph cannot see ----------------------------------

def forbidden_imports(source: str) -> list:
    """Imports of the compiled core, a backend or a model in one module's source."""
    bad = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.ImportFrom):   # relative: from .. import _core
            names = [a.name for a in node.names if a.name == "_core"]
            bad += [f"relative {n}" for n in names]
            continue
        else:
            continue
        bad += [n for n in names if any(n == f or n.startswith(f + ".") for f in FORBIDDEN_IN_GRAPH)]
    return bad


def test_scanner_catches_core_imports():
    assert forbidden_imports("from minfer import _core") == ["minfer._core"]
    assert forbidden_imports("def f():\n    import minfer._core as c\n") == ["minfer._core"]
    assert forbidden_imports("from minfer.backends.cpu import ENTRY") == ["minfer.backends.cpu",
                                                                           "minfer.backends.cpu.ENTRY"]
    assert forbidden_imports("from .. import _core") == ["relative _core"]
    assert forbidden_imports("from minfer.graph import ir\nimport numpy") == []


def test_graph_sources_never_import_the_core_backends_or_models():
    files = sorted((PKG / "graph").glob("*.py"))
    assert len(files) > 5
    found = {f.name: forbidden_imports(f.read_text()) for f in files}
    assert {k: v for k, v in found.items() if v} == {}


def test_importing_the_whole_graph_loads_no_core_backend_or_model():
    mods = [f"minfer.graph.{f.stem}" for f in sorted((PKG / "graph").glob("*.py")) if f.stem != "__init__"]
    code = ("import sys\n" + "".join(f"import {m}\n" for m in mods) +
            f"print(sorted(m for m in sys.modules if m.startswith({FORBIDDEN_IN_GRAPH!r})))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
