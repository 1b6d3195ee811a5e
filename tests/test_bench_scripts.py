"""bench/ scripts run against the installed minfer (pip install .): none puts the source
tree's python/ on its own sys.path, where it would shadow the install (whose compiled
core the source tree lacks). bench/cpu_sweep.py builds and measures the checkout itself
and hands its python/ to its child processes only (PYTHONPATH), never to its own path."""

from __future__ import annotations

import ast
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _path_edits(tree: ast.AST):
    """Calls and assignments that change sys.path (insert, append, extend, slices)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if (isinstance(owner, ast.Attribute) and owner.attr == "path" and isinstance(owner.value, ast.Name)
                    and owner.value.id == "sys"):
                yield node
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if "sys.path" in ast.unparse(t):
                    yield node


def test_bench_scripts_do_not_put_the_source_tree_on_sys_path():
    scripts = sorted(BENCH.glob("*.py"))
    assert scripts
    bad = []
    for p in scripts:
        for node in _path_edits(ast.parse(p.read_text(), str(p))):
            text = ast.unparse(node)
            if '"python"' in text or "'python'" in text:  # the source tree's package folder
                bad.append(f"{p.name}:{node.lineno}: {text}")
    assert not bad, "bench scripts must import the installed minfer:\n" + "\n".join(bad)


def test_the_check_sees_a_source_tree_insert(tmp_path):
    src = 'import sys\nfrom pathlib import Path\nsys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))\n'
    assert [ast.unparse(n) for n in _path_edits(ast.parse(src))]
