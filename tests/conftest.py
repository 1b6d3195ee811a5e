"""Shared fixtures. Keep this small: fixtures used by one test module live there."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    # On CI nothing skips: a skip there stands in for a missing tool or a broken import,
    # so it is reported as the failure it is.
    outcome = yield
    rep = outcome.get_result()
    if rep.skipped and os.environ.get("CI") and not hasattr(rep, "wasxfail"):
        rep.outcome = "failed"
        rep.longrepr = f"skipped on CI (CI={os.environ['CI']}), which counts as a failure: {rep.longrepr}"


def pytest_collectreport(report):
    if report.skipped and os.environ.get("CI"):
        report.outcome = "failed"


@pytest.fixture(scope="session")
def real_model_path() -> Path:
    """The real default model, fetched once per machine through minfer's own cache
    (honours $MINFER_CACHE). A failed fetch is an error, not a skip."""
    from minfer.io.model_cache import default_model_path

    return default_model_path(pull=True, progress=False)


@pytest.fixture(scope="session")
def synth_model_path(tmp_path_factory) -> Path:
    """A tiny random-weight qwen2 model (all F32, with tokenizer), shared read-only."""
    from minfer.testing import write_model

    path = tmp_path_factory.mktemp("synth") / "qwen2-tiny.gguf"
    write_model(path)
    return path


@pytest.fixture(scope="session")
def mixed_model_path(tmp_path_factory) -> Path:
    """A small random-weight qwen2 model with mixed weight types (Q8_0 ffn_up, Q4_0
    attn_q, the rest F32): the engine and scheduler tests' model."""
    from minfer.testing import write_model

    path = tmp_path_factory.mktemp("mixed") / "m.gguf"
    write_model(path, n_embd=128, n_head=4, n_head_kv=2, n_ff=256, types={"ffn_up": "Q8_0", "attn_q": "Q4_0"})
    return path


@pytest.fixture(scope="session")
def mixed_model(mixed_model_path):
    from minfer.model import Model

    return Model.open(mixed_model_path, n_threads=2)
