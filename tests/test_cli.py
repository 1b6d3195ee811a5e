"""The command line as a user meets it: exit codes, one-line errors, JSON output,
streaming, and the bad-input contract (clear error, never a crash)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from minfer.cli import main


def run(capsys, *args):
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def test_version(capsys):
    rc, out, _ = run(capsys, "--version")
    assert rc == 0 and out.startswith("minfer ")


def test_help_lists_commands(capsys):
    rc, out, _ = run(capsys, "--help")
    assert rc == 0
    for cmd in ("pull", "info", "tokenize", "generate", "perplexity", "bench"):
        assert cmd in out


@pytest.mark.parametrize("args", [["bogus"], ["info", "--nope"], ["generate", "a", "b", "c"], ["bench", "-o", "xml"],
                                  ["generate", "p", "-n", "x"]])
def test_bad_arguments_exit_2_with_one_line(capsys, args):
    rc, out, err = run(capsys, *args)
    assert rc == 2
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("minfer: error:")


def test_console_script_exit_code():
    # The installed entry point, not just main(): argument errors exit 2.
    p = subprocess.run([sys.executable, "-m", "minfer.cli", "no-such-command"], capture_output=True, text=True)
    assert p.returncode == 2 and "No such command" in p.stderr


def test_missing_model_file_is_one_line_error(capsys, tmp_path):
    rc, _, err = run(capsys, "info", str(tmp_path / "nope.gguf"))
    assert rc == 1 and err.count("\n") == 1 and "not found" in err


def test_truncated_gguf_is_clean_error(capsys, tmp_path, synth_model_path):
    data = synth_model_path.read_bytes()
    bad = tmp_path / "trunc.gguf"
    bad.write_bytes(data[: len(data) // 2])
    rc, _, err = run(capsys, "generate", str(bad), "hi", "-n", "2")
    assert rc == 1 and err.startswith("minfer: error:") and err.count("\n") == 1


def test_info_on_model(capsys, synth_model_path):
    rc, out, _ = run(capsys, "info", str(synth_model_path))
    assert rc == 0 and "qwen2" in out and "token_embd.weight" in out


def test_tokenize_json(capsys, synth_model_path):
    rc, out, _ = run(capsys, "tokenize", str(synth_model_path), "hello world")
    ids = json.loads(out)
    assert rc == 0 and isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids)


def test_generate_json_greedy_is_deterministic(capsys, synth_model_path):
    args = ["generate", str(synth_model_path), "hello", "-n", "8", "--temp", "0", "--json", "--ctx", "64"]
    rc, out1, _ = run(capsys, *args)
    assert rc == 0
    r1 = json.loads(out1)
    rc, out2, _ = run(capsys, *args)
    r2 = json.loads(out2)
    assert r1["ids"] == r2["ids"] and r1["text"] == r2["text"]
    assert set(r1) >= {"text", "ids", "prompt_ids", "stop_reason", "timings"}
    assert r1["stop_reason"] in ("length", "eos", "stop")
    assert len(r1["ids"]) <= 8


def test_generate_seeded_sampling_repeats(capsys, synth_model_path):
    args = ["generate", str(synth_model_path), "abc", "-n", "8", "--temp", "1.0", "--seed", "7", "--json", "--ctx", "64"]
    _, o1, _ = run(capsys, *args)
    _, o2, _ = run(capsys, *args)
    assert json.loads(o1)["ids"] == json.loads(o2)["ids"]


def test_generate_streams_text_and_timings(capsys, synth_model_path):
    rc, out, err = run(capsys, "generate", str(synth_model_path), "hello", "-n", "4", "--temp", "0", "--ctx", "64")
    assert rc == 0
    assert "tok/s" in err and "load" in err


def test_prompt_longer_than_context_is_error_before_work(capsys, synth_model_path):
    rc, _, err = run(capsys, "generate", str(synth_model_path), "x " * 200, "-n", "4", "--ctx", "32")
    assert rc == 1 and "context" in err


def test_kv_type_f32_and_f16_generate(capsys, synth_model_path):
    """Both KV types run; f32 is the exact path, f16 stores K/V rounded (the synthetic
    model's greedy ids need not agree, so only the run itself is asserted here; the
    numerics are pinned in test_cpu_ops and test_e2e_synthetic)."""
    for kv in ("f32", "f16"):
        rc, out, err = run(capsys, "generate", str(synth_model_path), "hello", "-n", "4", "--temp", "0", "--json",
                           "--ctx", "64", "--kv-type", kv)
        assert rc == 0, err
        assert len(json.loads(out)["ids"]) == 4


def test_bad_kv_type_is_usage_error(capsys, synth_model_path):
    rc, _, err = run(capsys, "generate", str(synth_model_path), "hi", "-n", "1", "--kv-type", "q4")
    assert rc == 2 and "--kv-type" in err and "Traceback" not in err


def test_ctx_above_trained_context_warns_once(capsys, synth_model_path):
    from minfer.io.gguf_file import GGUFFile

    md = GGUFFile.open(synth_model_path).metadata
    n_train = int(md[f"{md['general.architecture']}.context_length"])
    rc, _, err = run(capsys, "generate", str(synth_model_path), "hi", "-n", "2", "--temp", "0",
                     "--ctx", str(n_train + 64))
    assert rc == 0
    assert err.count("trained context") == 1 and f"({n_train})" in err
    rc, _, err = run(capsys, "generate", str(synth_model_path), "hi", "-n", "2", "--temp", "0", "--ctx", str(n_train))
    assert rc == 0 and "trained context" not in err


def test_impossible_kv_is_one_line_error_naming_bytes(capsys, synth_model_path):
    """A KV cache larger than RAM + swap: one line, the bytes it needs, exit 1."""
    rc, out, err = run(capsys, "generate", str(synth_model_path), "hi", "-n", "1", "--temp", "0",
                       "--ctx", str(2_000_000_000), "--kv-type", "f32")
    assert rc == 1 and out == ""
    line = [ln for ln in err.splitlines() if not ln.startswith("minfer: warning:")]
    assert len(line) == 1 and "cannot allocate the KV cache" in line[0] and "bytes" in line[0], err
    assert "Traceback" not in err


def test_unknown_backend_is_refused(capsys, synth_model_path):
    rc, _, err = run(capsys, "generate", str(synth_model_path), "hi", "-n", "1", "--backend", "tpu")
    assert rc == 1 and "unknown" in err.lower() and "tpu" in err


def test_uncompiled_backend_is_refused(capsys, synth_model_path):
    rc, _, err = run(capsys, "generate", str(synth_model_path), "hi", "-n", "1", "--backend", "metal")
    assert rc == 1 and "metal" in err.lower()


def test_dump_graph_prefill_and_decode(capsys, tmp_path, synth_model_path):
    for decode in (False, True):
        path = tmp_path / f"g{int(decode)}.dot"
        args = ["--dump-graph", str(path), str(synth_model_path), "hello there"] + (["--decode"] if decode else [])
        rc, _, _ = run(capsys, *args)
        assert rc == 0
        text = path.read_text()
        assert text.startswith("digraph") and "MatMul" in text
        assert ("tail_ids" in text) != decode  # prefill has G3 tail rows, decode has none


def test_dump_graph_of_the_real_model_renders(capsys, tmp_path, real_model_path):
    import shutil

    path = tmp_path / "real.dot"
    rc, _, _ = run(capsys, "--dump-graph", str(path), str(real_model_path), "hello")
    assert rc == 0
    text = path.read_text()
    # 7 matmuls per layer (q, k, v, o, gate, up, down) x 24 layers + the lm head
    assert text.count("\\nMatMul") == 24 * 7 + 1
    assert "SwiGLU" in text  # the graph shows what runs: after the fusion pass
    dot = shutil.which("dot")
    assert dot, "graphviz 'dot' is missing: apt-get install graphviz (or run the suite with `bash .ci/run`)"
    svg = tmp_path / "real.svg"
    subprocess.run([dot, "-Tsvg", str(path), "-o", str(svg)], check=True, timeout=120)
    assert "<svg" in svg.read_text()[:2000]


def test_graph_trace_env_prints_splits(capsys, monkeypatch, synth_model_path):
    monkeypatch.setenv("MINFER_GRAPH_TRACE", "1")
    rc, _, err = run(capsys, "generate", str(synth_model_path), "hi", "-n", "2", "--temp", "0", "--ctx", "32")
    assert rc == 0
    assert "split" in err.lower() and "MatMul" in err
