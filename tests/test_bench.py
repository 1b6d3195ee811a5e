"""minfer bench: llama-bench-compatible output, argument parsing, and the runner's
structure (never its speed: timings are not assertions)."""

from __future__ import annotations

import csv
import io
import json
import math
import statistics

import numpy as np
import pytest

from minfer.tools.bench import (
    FIELDS, BenchArgumentError, BenchResult, format_results, parse_int_list, run_bench,
)
from minfer.errors import MinferError

LLAMA_BENCH_JSON_FIELDS = [
    "build_commit", "build_number", "cpu_info", "gpu_info", "backends", "model_filename",
    "model_type", "model_size", "model_n_params", "n_batch", "n_ubatch", "n_threads",
    "type_k", "type_v", "n_gpu_layers", "flash_attn", "n_prompt", "n_gen", "n_depth", "test_time",
    "avg_ns", "stddev_ns", "avg_ts", "stddev_ts", "samples_ns", "samples_ts",
]


def _result(n_prompt=512, n_gen=0, samples=(1_000_000_000, 2_000_000_000), **kw) -> BenchResult:
    base = dict(
        model_filename="/m/model.gguf", model_type="qwen2 0.5B Q4_K - Medium",
        model_size=491_400_032, model_n_params=494_032_768, backends="CPU", n_threads=2,
        n_prompt=n_prompt, n_gen=n_gen, samples_ns=list(samples), build_commit="abc1234",
        build_number=7, cpu_info="Test CPU", test_time="2026-01-01T00:00:00Z",
        peak_rss_bytes=300 * 1024 * 1024, mem_bw_bytes_per_s=20e9,
        weight_bytes_per_token=400_000_000,
    )
    base.update(kw)
    return BenchResult(**base)


# ------------------------------------------------------------------ statistics


def test_ts_statistics_follow_llama_bench_per_sample_order():
    r = _result(n_prompt=512, samples=(1_000_000_000, 2_000_000_000))
    # t/s is per sample first (512, 256), then mean and sample stdev of those.
    assert r.samples_ts == pytest.approx([512.0, 256.0])
    assert r.avg_ts == pytest.approx(384.0)
    assert r.stddev_ts == pytest.approx(statistics.stdev([512.0, 256.0]))
    assert r.avg_ns == 1_500_000_000
    assert r.stddev_ns == int(statistics.stdev([1e9, 2e9]))


def test_single_sample_has_zero_stddev():
    r = _result(samples=(5_000_000,))
    assert r.stddev_ts == 0.0 and r.stddev_ns == 0


def test_mem_bw_frac_only_for_tg():
    pp = _result(n_prompt=128)
    tg = _result(n_prompt=0, n_gen=100, samples=(2_000_000_000,))  # 50 t/s
    assert pp.mem_bw_frac is None
    assert tg.mem_bw_frac == pytest.approx(400e6 * 50 / 20e9)
    assert _result(n_prompt=0, n_gen=10, mem_bw_bytes_per_s=None).mem_bw_frac is None


def test_test_names():
    assert _result(n_prompt=512, n_gen=0).test_name == "pp512"
    assert _result(n_prompt=0, n_gen=128).test_name == "tg128"
    assert _result(n_prompt=16, n_gen=4).test_name == "pp16+tg4"
    assert _result(n_prompt=0, n_gen=128, n_depth=4096).test_name == "tg128 @ d4096"


# ------------------------------------------------------------------ formats


def test_md_table_matches_llama_bench_layout():
    text = format_results([_result(), _result(n_prompt=0, n_gen=128, samples=(2_000_000_000,))],
                          "md")
    lines = text.splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header[:7] == ["model", "size", "params", "backend", "threads", "test", "t/s"]
    sep = [c.strip() for c in lines[1].strip("|").split("|")]
    assert sep[0].endswith("-") and not sep[0].endswith(":")  # model is left-aligned
    assert sep[6].endswith(":")  # t/s is right-aligned
    row = [c.strip() for c in lines[2].strip("|").split("|")]
    assert row[:7] == ["qwen2 0.5B Q4_K - Medium", "468.64 MiB", "494.03 M", "CPU", "2",
                       "pp512", "384.00 ± 181.02"]
    tg = [c.strip() for c in lines[3].strip("|").split("|")]
    assert tg[5] == "tg128" and tg[6] == "64.00 ± 0.00"
    assert tg[7] == "300 MiB" and tg[8] == f"{100 * 400e6 * 64 / 20e9:.1f}%"
    assert row[8] == "-"  # no bandwidth fraction for pp
    assert "build: abc1234 (7)" in text
    # Every table line has the same number of cells.
    assert len({ln.count("|") for ln in lines[:4]}) == 1


def test_md_without_extras_is_exactly_llama_bench_columns():
    lines = format_results([_result()], "md", extras=False).splitlines()
    assert [c.strip() for c in lines[0].strip("|").split("|")] == [
        "model", "size", "params", "backend", "threads", "test", "t/s"]


def test_md_sizes_switch_to_gib_and_billions():
    row = format_results([_result(model_size=3 * 1024 ** 3, model_n_params=7_240_000_000)],
                         "md").splitlines()[2]
    assert "3.00 GiB" in row and "7.24 B" in row


def test_json_has_llama_bench_fields_and_values():
    rs = [_result(), _result(n_prompt=0, n_gen=64, samples=(1_000_000_000, 1_000_000_000))]
    data = json.loads(format_results(rs, "json"))
    assert isinstance(data, list) and len(data) == 2
    for name in LLAMA_BENCH_JSON_FIELDS + ["peak_rss_bytes", "mem_bw_frac"]:
        assert name in data[0], name
    pp, tg = data
    assert pp["n_prompt"] == 512 and pp["n_gen"] == 0
    assert tg["n_prompt"] == 0 and tg["n_gen"] == 64
    assert isinstance(pp["model_size"], int) and pp["model_size"] == 491_400_032
    assert pp["samples_ns"] == [1_000_000_000, 2_000_000_000]
    assert pp["samples_ts"] == pytest.approx([512.0, 256.0])
    assert pp["avg_ts"] == pytest.approx(384.0)
    assert pp["avg_ns"] == 1_500_000_000
    assert pp["backends"] == "CPU" and pp["n_threads"] == 2
    assert pp["mem_bw_frac"] is None
    assert tg["mem_bw_frac"] == pytest.approx(400e6 * 64 / 20e9)
    assert tg["stddev_ts"] == 0.0


def test_csv_header_and_rows():
    rs = [_result(), _result(n_prompt=0, n_gen=32, samples=(1_000_000_000,))]
    text = format_results(rs, "csv")
    first = text.splitlines()[0]
    assert first == ",".join(FIELDS)  # unquoted header, as llama-bench
    rows = list(csv.DictReader(io.StringIO(text)))
    assert len(rows) == 2
    for name in LLAMA_BENCH_JSON_FIELDS:
        assert name in rows[0]
    assert rows[0]["model_type"] == "qwen2 0.5B Q4_K - Medium"
    assert int(rows[0]["n_prompt"]) == 512 and int(rows[1]["n_gen"]) == 32
    assert float(rows[0]["avg_ts"]) == pytest.approx(384.0)
    assert rows[0]["mem_bw_frac"] == ""
    assert float(rows[1]["mem_bw_frac"]) == pytest.approx(400e6 * 32 / 20e9)
    assert [int(x) for x in rows[0]["samples_ns"].split()] == [1_000_000_000, 2_000_000_000]
    # Every cell is quoted, which is what llama-bench writes.
    assert text.splitlines()[1].startswith('"abc1234",')


def test_unknown_format_is_a_clear_error():
    with pytest.raises(MinferError, match="md, json or csv"):
        format_results([_result()], "xml")


# ------------------------------------------------------------------ parse_int_list


@pytest.mark.parametrize("text,expected", [
    ("512", [512]), ("128,512", [128, 512]), (" 1, 2 ,3 ", [1, 2, 3]), ("0,16", [0, 16]),
    (64, [64]), ([1, 2], [1, 2]),
])
def test_parse_int_list_accepts(text, expected):
    assert parse_int_list(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "1,,2", "1.5", "12,x", "-4", "1;2"])
def test_parse_int_list_rejects_junk_clearly(text):
    with pytest.raises(BenchArgumentError) as ei:
        parse_int_list(text)
    assert isinstance(ei.value, ValueError) and isinstance(ei.value, MinferError)
    assert repr(text) in str(ei.value) or "negative" in str(ei.value)


# ------------------------------------------------------------------ runner (fake engine)


class FakeEngine:
    """Records what the runner asks of an engine; stands in for Engine in structure tests."""

    def __init__(self, n_threads):
        self.n_threads = n_threads
        self.n_past = 0
        self.calls: list[tuple[str, int]] = []
        self.model_info = {"arch": "qwen2", "n_params": 1000, "size_bytes": 4096,
                           "type": "qwen2 tiny F32", "weight_bytes_per_token": 4000,
                           "n_vocab": 50}
        self.kv_type = "f16"
        self.backend_names = ["CPU"]

    def reset(self):
        self.n_past = 0
        self.calls.append(("reset", 0))

    def forward(self, tokens, n_out=1, copy=True):
        assert all(0 <= t < 50 for t in tokens)
        assert copy is False, "the bench reads the logits back as a view, like the decode loop"
        self.n_past += len(tokens)
        self.calls.append(("fwd", len(tokens)))
        return np.zeros((n_out, 50), np.float32)


def fake_run(tmp_path):
    """A model file, and an engine loader that records each FakeEngine it makes and the
    context it was asked for: (model, engines, seen_ctx, loader)."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x")
    engines: list[FakeEngine] = []
    seen_ctx: list[int] = []

    def loader(path, *, n_ctx, n_threads, backends):
        seen_ctx.append(n_ctx)
        engines.append(FakeEngine(n_threads))
        return engines[-1]

    return model, engines, seen_ctx, loader


def test_run_bench_structure_with_fake_engine(tmp_path):
    model, engines, seen_ctx, loader = fake_run(tmp_path)
    lines: list[str] = []
    rs = run_bench(model, n_prompt=[8, 0], n_gen=[5], reps=3, threads=[1, 2],
                   progress=lines.append, mem_bandwidth=1e9, engine_loader=loader)
    assert [(r.test_name, r.n_threads) for r in rs] == [
        ("pp8", 1), ("tg5", 1), ("pp8", 2), ("tg5", 2)]
    assert seen_ctx == [8, 8]  # max(pp 8, tg 5 + 1 prefill)
    for r in rs:
        assert len(r.samples_ns) == 3 and all(s > 0 for s in r.samples_ns)
        assert r.avg_ts > 0 and r.peak_rss_bytes > 0
        assert r.model_type == "qwen2 tiny F32" and r.backends == "CPU"
    assert rs[0].mem_bw_frac is None and rs[1].mem_bw_frac is not None
    calls = engines[0].calls
    # pp: warm-up + 3 reps, each a reset then one forward of all 8 tokens.
    assert calls[:8] == [("reset", 0), ("fwd", 8)] * 4
    # tg: warm-up (reset, prefill 1, one step), then per rep reset, prefill 1, 5 single steps.
    tg = calls[8:]
    assert tg[:3] == [("reset", 0), ("fwd", 1), ("fwd", 1)]
    assert tg[3:] == ([("reset", 0), ("fwd", 1)] + [("fwd", 1)] * 5) * 3
    assert any("warm-up" in ln for ln in lines) and any("run 3/3" in ln for ln in lines)


def test_bandwidth_probe_runs_with_each_thread_count(tmp_path, monkeypatch):
    """The mem bw column of a t-thread row is against a probe read by t threads (one
    thread cannot stream what every core does), probed once per thread count before
    its tests, and the footer names each probe."""
    from minfer.tools import bench as bench_mod
    probes: list = []

    def probe(n_threads=None):
        probes.append(n_threads)
        return {1: 20e9, 2: 36e9}[n_threads]

    monkeypatch.setattr(bench_mod, "measure_bandwidth_isolated", probe)
    model, engines, _, loader = fake_run(tmp_path)
    rs = run_bench(model, n_prompt=[8], n_gen=[5], reps=1, threads=[1, 2, 1], engine_loader=loader)
    assert probes == [1, 2]
    assert [(r.n_threads, r.mem_bw_bytes_per_s) for r in rs if r.n_gen] == [(1, 20e9), (2, 36e9), (1, 20e9)]
    tg1, tg2 = [r for r in rs if r.n_gen][:2]
    assert tg1.mem_bw_frac == pytest.approx(tg1.weight_bytes_per_token * tg1.avg_ts / 20e9)
    assert tg2.mem_bw_frac == pytest.approx(tg2.weight_bytes_per_token * tg2.avg_ts / 36e9)
    text = format_results(rs)
    assert "20.0 GB/s with 1 thread, 36.0 GB/s with 2 threads" in text


def test_run_bench_at_depth_prefills_untimed_first(tmp_path):
    """-d (llama-bench's n_depth): each test starts after an untimed forward of d tokens;
    the context holds the deepest test; the rows say their depth."""
    model, engines, seen_ctx, loader = fake_run(tmp_path)
    rs = run_bench(model, n_prompt=[8], n_gen=[5], reps=2, threads=[1], n_depth=[0, 32],
                   mem_bandwidth=False, engine_loader=loader)
    assert [(r.test_name, r.n_depth) for r in rs] == [("pp8", 0), ("pp8 @ d32", 32), ("tg5", 0), ("tg5 @ d32", 32)]
    assert seen_ctx == [32 + 8]
    calls = engines[0].calls
    # pp8 at depth 0: warm-up + 2 reps of (reset, 8); at depth 32: (reset, 32, 8) each.
    assert calls[:6] == [("reset", 0), ("fwd", 8)] * 3
    assert calls[6:15] == [("reset", 0), ("fwd", 32), ("fwd", 8)] * 3
    # tg5 at depth 32: the depth and the first token in one untimed forward, then steps.
    tail = calls[-(3 + 7 * 2):]
    assert tail[:3] == [("reset", 0), ("fwd", 33), ("fwd", 1)]
    assert tail[3:] == ([("reset", 0), ("fwd", 33)] + [("fwd", 1)] * 5) * 2
    data = json.loads(format_results(rs, "json"))
    assert [d["n_depth"] for d in data] == [0, 32, 0, 32]
    with pytest.raises(BenchArgumentError):
        run_bench(model, [8], [0], reps=1, threads=[1], n_depth=[-1], mem_bandwidth=False, engine_loader=loader)


def test_run_bench_rejects_bad_arguments(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x")
    loader = lambda *a, **k: FakeEngine(1)  # noqa: E731
    with pytest.raises(BenchArgumentError):
        run_bench(model, [8], [0], reps=0, threads=[1], mem_bandwidth=False, engine_loader=loader)
    with pytest.raises(BenchArgumentError):
        run_bench(model, [8], [0], reps=1, threads=[0], mem_bandwidth=False, engine_loader=loader)
    with pytest.raises(MinferError, match="not found"):
        run_bench(tmp_path / "nope.gguf", [8], [0], reps=1, threads=[1], engine_loader=loader)
    assert run_bench(model, [0], [0], reps=1, threads=[1], engine_loader=loader) == []


# ------------------------------------------------------------------ bandwidth probe


def test_membw_probe_is_positive_and_counts_bytes_like_stream():
    from minfer.tools import membw
    rep = membw.measure(n_threads=2, array_bytes=8 << 20, repeats=1)
    for v in (rep.copy_bytes_per_s, rep.triad_bytes_per_s, rep.read_bytes_per_s):
        # A sanity bound, not a speed: another process on the cores can slow it 10x or more.
        assert math.isfinite(v) and v > 1e6
    assert rep.best == max(rep.copy_bytes_per_s, rep.triad_bytes_per_s, rep.read_bytes_per_s)
    assert rep.array_bytes % (2 * 8) == 0


# ------------------------------------------------------------------ real engine, tiny model


def test_run_bench_on_synthetic_model(synth_model_path):
    lines: list[str] = []
    rs = run_bench(synth_model_path, n_prompt=[8, 0], n_gen=[0, 4], reps=2, threads=[1],
                   progress=lines.append, mem_bandwidth=10e9)
    assert [r.test_name for r in rs] == ["pp8", "tg4"]
    for r in rs:
        assert len(r.samples_ns) == 2 and all(s > 0 for s in r.samples_ns)
        assert r.avg_ts > 0 and math.isfinite(r.stddev_ts)
        assert r.model_size > 0 and r.model_n_params > 0
        assert r.model_type.startswith("qwen2")
        assert r.backends and r.n_threads == 1
        assert r.peak_rss_bytes > 0
    assert rs[1].weight_bytes_per_token and rs[1].mem_bw_frac > 0
    data = json.loads(format_results(rs, "json"))
    assert [d["n_prompt"] for d in data] == [8, 0] and [d["n_gen"] for d in data] == [0, 4]
    assert any("run 2/2" in ln for ln in lines)
