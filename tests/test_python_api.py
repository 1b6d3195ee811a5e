"""The Python API: every code block of docs/python-api.md runs, in order, in one
namespace, on the default model (the examples assert what they show), and the API's
errors are one-line MinferErrors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import minfer
from minfer.errors import MinferError

DOC = Path(__file__).resolve().parent.parent / "docs" / "python-api.md"


def blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def test_the_documented_examples_run(real_model_path, capsys):
    code = blocks()
    assert len(code) >= 8
    ns: dict = {}
    for i, src in enumerate(code):
        exec(compile(src, f"{DOC.name} block {i + 1}", "exec"), ns)
    assert isinstance(ns["llm"], minfer.LLM)
    assert capsys.readouterr().out.strip()


def test_api_errors(tmp_path, synth_model_path):
    with pytest.raises(MinferError, match="not found"):
        minfer.load(tmp_path / "nope.gguf")
    llm = minfer.load(synth_model_path, threads=2, n_ctx=64, max_batch=2)
    with pytest.raises(TypeError, match="temprature"):
        llm.generate("hi", temprature=0.5)
    with pytest.raises(MinferError):
        llm.generate("hi", max_tokens=4, n=3)          # more choices than max_batch
    with pytest.raises(MinferError):
        llm.generate("hi", max_tokens=4, top_p=2.0)
    with pytest.raises(MinferError):
        llm.generate("hi", max_tokens=1000)            # past n_ctx
    out = llm.generate([1, 2, 3], max_tokens=3, temperature=0)
    assert isinstance(out, minfer.Completion) and len(out.ids) <= 3
