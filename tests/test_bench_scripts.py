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


def test_with_vocab_gives_a_shaped_model_a_real_vocabulary(tmp_path):
    """bench/with_vocab.py: the model's tensors as they were, the vocabulary file's
    tokenizer (Qwen2's, from llama.cpp's vocab-only GGUF: its test vectors' ids), and a
    vocabulary larger than the model's rows refused in one line."""
    import subprocess
    import sys

    import numpy as np

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import families
    from minfer.model import Model
    from minfer.testing import write_model

    voc = families.converter_dir() / "models" / "ggml-vocab-qwen2.gguf"
    src, out = tmp_path / "m.gguf", tmp_path / "out.gguf"
    write_model(src, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, n_vocab=151936, with_tokenizer=False, fast=True)
    r = subprocess.run([sys.executable, str(BENCH / "with_vocab.py"), str(src), str(voc), str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    tok = Model.open(out).tokenizer
    inp = (voc.parent / (voc.name + ".inp")).read_text().split("\n__ggml_vocab_test__\n")
    want = (voc.parent / (voc.name + ".out")).read_text().split("\n")
    for text, ids in list(zip(inp, want))[:12]:
        assert tok.encode(text, add_bos=False) == [int(x) for x in ids.split()], text
    import gguf
    a, b = gguf.GGUFReader(str(src)), gguf.GGUFReader(str(out))
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    assert all(np.array_equal(x.data, y.data) for x, y in zip(a.tensors, b.tensors))
    small = tmp_path / "small.gguf"
    write_model(small, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, n_vocab=1000, with_tokenizer=False, fast=True)
    r = subprocess.run([sys.executable, str(BENCH / "with_vocab.py"), str(small), str(voc), str(tmp_path / "x.gguf")],
                       capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "151" in r.stderr
    # More rows than entries (Qwen2-7B's 152,064): padded with unused entries, so every
    # id the output can pick has a token, and text ids are unchanged.
    big, padded = tmp_path / "big.gguf", tmp_path / "padded.gguf"
    write_model(big, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, n_vocab=152064, with_tokenizer=False, fast=True)
    r = subprocess.run([sys.executable, str(BENCH / "with_vocab.py"), str(big), str(voc), str(padded)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    m = Model.open(padded)
    assert m.hp.n_vocab == 152064 and m.tokenizer.decode([152063]) in ("", "[PAD152063]")
    assert m.tokenizer.encode(inp[0], add_bos=False) == [int(x) for x in want[0].split()]
