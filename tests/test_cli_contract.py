"""The command-line contract, through the installed `minfer` console script in a
subprocess: real exit codes, real signals, real pipes.

Every case asserts the exit code, a short stderr without a traceback, and that
nothing was written where nothing should be (each run gets an empty working folder
and an empty MINFER_CACHE, checked afterwards). Models are tiny synthetic files; the
lying ones are made with minfer.testing.synth's knobs or by patching bytes.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from minfer.limits import MAX_CTX, logical_cpus
from minfer.testing import write_model
from minfer.testing.synth import patch_tensor_offset

TIMEOUT = 60  # seconds, per subprocess: a hang is a failure, never a stuck suite


def _minfer_exe() -> str:
    # The console script that sits beside this interpreter (the venv's, or CI's
    # pip-installed one); PATH as a fallback. Missing is a failure, not a skip.
    here = Path(sys.executable).with_name("minfer")
    exe = str(here) if here.exists() else shutil.which("minfer")
    assert exe, "the `minfer` console script is not installed (pip install .)"
    return exe


MINFER = _minfer_exe()


def _base_env() -> dict:
    # Commands run in a sandbox folder: a relative PYTHONPATH / MINFER_CORE_DIR (the
    # developer's `PYTHONPATH=python`) must keep pointing at this tree from there.
    env = dict(os.environ)
    if env.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.pathsep.join(str(Path(p).resolve()) for p in env["PYTHONPATH"].split(os.pathsep) if p)
    if env.get("MINFER_CORE_DIR"):
        env["MINFER_CORE_DIR"] = str(Path(env["MINFER_CORE_DIR"]).resolve())
    env.pop("MINFER_BACKENDS", None)
    return env


BASE_ENV = _base_env()


class Run:
    def __init__(self, p: subprocess.CompletedProcess, cwd: Path, cache: Path):
        self.rc, self.out, self.err = p.returncode, p.stdout, p.stderr
        self.cwd, self.cache = cwd, cache

    def __repr__(self) -> str:
        return f"rc={self.rc}\nstdout={self.out[-500:]!r}\nstderr={self.err[-2000:]!r}"


@pytest.fixture
def sandbox(tmp_path):
    """An empty working folder and an empty model cache for one command."""
    cwd, cache = tmp_path / "cwd", tmp_path / "cache"
    cwd.mkdir()
    cache.mkdir()
    return cwd, cache


def run(sandbox, *args, env: dict | None = None, timeout: float = TIMEOUT) -> Run:
    cwd, cache = sandbox
    e = dict(BASE_ENV, MINFER_CACHE=str(cache))
    e.update(env or {})
    p = subprocess.run([MINFER, *map(str, args)], cwd=cwd, env=e, capture_output=True, text=True,
                       errors="replace", timeout=timeout, stdin=subprocess.DEVNULL)
    return Run(p, cwd, cache)


def lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


def assert_clean(r: Run, rc: int, *needles: str, max_lines: int = 1, wrote: tuple[str, ...] = ()) -> None:
    """Exit code rc, at most max_lines short stderr lines without a traceback, every
    needle in stderr, and no file in the sandbox other than those in `wrote`."""
    assert r.rc == rc, r
    assert "Traceback" not in r.err and "Error:" not in r.err.replace("minfer: error:", ""), r
    ls = lines(r.err)
    assert len(ls) <= max_lines and all(len(ln) < 600 for ln in ls), r
    if rc != 0:
        assert ls and ls[-1].startswith("minfer: error:"), r
    for n in needles:
        assert n in r.err, (n, r)
    made = sorted(str(p.relative_to(r.cwd)) for p in r.cwd.rglob("*"))
    assert made == sorted(wrote), made
    assert not any(r.cache.iterdir()), list(r.cache.iterdir())


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("contract-models")
    small = dict(n_layer=1, n_embd=32, n_head=2, n_head_kv=1, n_ff=64)
    m = {}
    m["ok"] = write_model(d / "ok.gguf", **small).path
    m["two"] = write_model(d / "two.gguf").path  # 2 layers, context_length 256
    # Trained for a long context, so long runs need no --ctx above it (which warns).
    m["noeog"] = write_model(d / "noeog.gguf", with_eog=False, ctx=1 << 17, **small).path
    m["nan"] = write_model(d / "nan.gguf", fill={"output_norm.weight": math.nan}, **small).path
    m["inf"] = write_model(d / "inf.gguf", fill={"blk.0.ffn_norm.weight": math.inf}, **small).path
    return m


@pytest.fixture
def sb(sandbox):
    return lambda *a, **k: run(sandbox, *a, **k)


# ---- bad arguments: one line, exit 2, before the model is even opened ------------------

BAD_GENERATE = [
    (["--temp", "nan"], "--temp"),
    (["--temp", "inf"], "--temp"),
    (["--temp", "-1"], "--temp"),
    (["--repeat-penalty", "nan"], "--repeat-penalty"),
    (["--repeat-penalty", "0"], "--repeat-penalty"),
    (["--repeat-penalty", "-inf"], "--repeat-penalty"),
    (["--top-p", "2"], "--top-p"),
    (["--top-p", "0"], "--top-p"),
    (["--top-p", "nan"], "--top-p"),
    (["--min-p", "1"], "--min-p"),
    (["--min-p", "-0.5"], "--min-p"),
    (["--top-k", "-1"], "--top-k"),
    (["--ctx", "-5"], "--ctx"),
    (["--ctx", str(MAX_CTX + 1)], "--ctx"),
    (["-n", "-1"], "-n"),
    (["--seed", "-2"], "--seed"),
    (["--seed", str(1 << 64)], "--seed"),
    (["--threads", "0"], "--threads"),
    (["--threads", "-2"], "--threads"),
    (["--backend", ""], "--backend"),
    (["--backend", " , "], "--backend"),
    (["--temp", "warm"], "--temp"),
    (["--kv-type", "q8"], "--kv-type"),
    (["--ctx", "-1", "--kv-type", "f32"], "--ctx"),
    (["--bogus"], "--bogus"),
]


@pytest.mark.parametrize("extra,needle", BAD_GENERATE, ids=[" ".join(a) or "empty" for a, _ in BAD_GENERATE])
def test_generate_bad_argument_exits_2(sb, models, extra, needle):
    r = sb("generate", models["ok"], "hi", "-n", "2", *extra)
    assert_clean(r, 2, needle)
    assert r.out == ""


@pytest.mark.parametrize("extra,needle", [
    (["-t", "0"], "-t"), (["-t", "-2"], "-t"), (["-t", "2,x"], "-t"), (["-r", "0"], "-r"), (["-o", "xml"], "-o"),
    (["-p", "-3"], "use 0 to skip a test"),
])
def test_bench_bad_argument_exits_2(sb, models, extra, needle):
    r = sb("bench", models["ok"], "-p", "8", "-n", "2", "-r", "1", *extra)
    assert_clean(r, 2, needle)
    if extra[0] == "-t":
        assert "skip a test" not in r.err  # the -p/-n hint is not one for threads
    assert r.out == ""


@pytest.mark.parametrize("cmd,needle", [
    (["chat", "{m}", "--temp", "nan"], "--temp"),
    (["chat", "{m}", "--seed", "-7"], "--seed"),
    (["chat", "{m}", "--threads", "0"], "--threads"),
    (["profile", "{m}", "hi", "--ctx", "-1"], "--ctx"),
    (["serve", "{m}", "--threads", "0"], "--threads"),
    (["serve", "{m}", "--ctx", "256", "--slots", "2", "--kv-cells", "100"], "--kv-cells"),
    (["serve", "{m}", "--ctx", "256", "--slots", "2", "--kv-cells", "600"], "[256, 512]"),
    (["viz", "{m}", "--threads", "-1"], "--threads"),
    (["generate", "{m}", "hi", "--dump-graph-json", "/no/such/folder/g.json"], "does not exist"),
])
def test_other_commands_share_the_rules(sb, models, cmd, needle):
    r = sb(*[models["ok"] if a == "{m}" else a for a in cmd])
    assert_clean(r, 2, needle)
    assert r.out == ""


def test_perplexity_bad_arguments_exit_2(sb, models, tmp_path):
    good = tmp_path / "good.txt"
    good.write_text("the cat sat on the mat. " * 40)
    binary = tmp_path / "latin1.txt"
    binary.write_bytes("caf\xe9 cr\xe8me ".encode("latin-1") * 50)
    assert_clean(sb("perplexity", models["ok"], "-f", good, "--chunks", "-1"), 2, "--chunks")
    assert_clean(sb("perplexity", models["ok"], "-f", binary), 2, "not UTF-8", "offset 3")
    assert_clean(sb("perplexity", models["ok"], "-f", tmp_path / "missing.txt"), 2, "missing.txt")
    assert_clean(sb("perplexity", models["ok"], "-f", tmp_path), 2, "directory")
    assert_clean(sb("perplexity", models["ok"], "-f", good, "--ctx", "-1"), 2, "--ctx")
    assert_clean(sb("perplexity", models["ok"], "-f", good, "-t", "0"), 2, "--threads")


def test_dump_graph_targets(sb, models, tmp_path):
    missing = tmp_path / "no" / "such" / "g.dot"
    assert_clean(sb("--dump-graph", missing, models["ok"], "hi"), 2, "does not exist")
    assert not missing.parent.exists()
    assert_clean(sb("--dump-graph", tmp_path, models["ok"], "hi"), 2, "is a directory")
    r = sb("--dump-graph", "/dev/full", models["ok"], "hi")
    assert_clean(r, 1, "/dev/full", "No space left")
    # Relative into the working folder: exactly that one file appears.
    r = sb("--dump-graph", "g.dot", models["ok"], "hi", "-t", "1")
    assert_clean(r, 0, "wrote prefill graph", wrote=("g.dot",))
    assert (r.cwd / "g.dot").read_text().startswith("digraph")


# ---- conventions (llama.cpp's where it has one) -----------------------------------------

def test_ctx_0_is_the_trained_context(sb, models):
    # two.gguf was trained with context_length 256: -n 300 cannot fit, -n 4 can.
    assert_clean(sb("generate", models["two"], "hi", "-n", "300", "--ctx", "0"), 1, "context of 256")
    assert_clean(sb("generate", models["two"], "hi", "-n", "4", "--ctx", "0", "--temp", "0", "-t", "1"), 0, max_lines=1)
    # The default (4096) is not the trained context: the same -n 300 fits there.
    assert_clean(sb("generate", models["two"], "hi", "-n", "300", "--temp", "0", "--json", "-t", "1"), 0, max_lines=0)


def test_seed_minus_one_is_random(sb, models):
    def ids(seed: str) -> tuple:
        r = sb("generate", models["noeog"], "hi", "-n", "24", "--temp", "1", "--seed", seed, "--json", "-t", "1")
        assert_clean(r, 0, max_lines=0)
        return tuple(json.loads(r.out)["ids"])

    # 24 draws over ~300 tokens each: equal outputs would mean a fixed seed.
    assert ids("-1") != ids("-1")
    assert ids("5") == ids("5")


@pytest.mark.parametrize("n", ["1000", "100000000"])
def test_threads_above_the_cpus_are_capped_with_a_warning(sb, models, n):
    r = sb("generate", models["ok"], "hi", "-n", "4", "--temp", "0", "--threads", n)
    assert_clean(r, 0, f"--threads {n} is more than the {logical_cpus()} logical CPUs", max_lines=2)
    assert lines(r.err)[0].startswith("minfer: warning:")


@pytest.mark.parametrize("kv,size", [("f16", 2), ("f32", 4)])
def test_huge_context_is_refused_naming_the_bytes(sb, models, kv, size):
    # The largest context the positions allow: over half a TB of KV even for the tiny
    # model (2 layers, K and V, kv_dim 32), refused before anything is allocated.
    r = sb("generate", models["two"], "hi", "-n", "1", "--ctx", str(MAX_CTX), "--kv-type", kv)
    need = 2 * 2 * 32 * MAX_CTX * size
    assert_clean(r, 1, "cannot allocate the KV cache", f"need {need} bytes", max_lines=2)
    assert "above the model's trained context" in r.err  # the one other line: the warning


def test_backend_names_follow_one_rule(sb, models):
    base = ("generate", models["ok"], "hi", "-n", "2", "--temp", "0", "--json", "-t", "1")
    for env, flag in (({}, ["--backend", "CPU"]), ({"MINFER_BACKENDS": "CPU"}, []),
                      ({}, ["--backend", " cpu "]), ({"MINFER_BACKENDS": " Cpu "}, [])):
        assert_clean(sb(*base, *flag, env=env), 0, max_lines=0)
    a = sb(*base, "--backend", "TPU")
    b = sb(*base, env={"MINFER_BACKENDS": "TPU"})
    assert_clean(a, 1, "unknown backend 'tpu'")
    assert_clean(b, 1, "unknown backend 'tpu'")
    assert a.err == b.err


@pytest.mark.parametrize("kind", ["file", "under-file", "uncreatable"])
def test_unusable_model_cache_is_one_line(sandbox, tmp_path, kind):
    reg = tmp_path / "regular"
    reg.write_text("not a folder")
    if kind == "file":
        cache = reg
    elif kind == "under-file":
        cache = reg / "sub"
    elif os.geteuid() == 0:
        cache = Path("/proc/minfer-cache")  # root may write anywhere but here
    else:
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        cache = ro / "cache"
    for cmd in (["pull"], ["info"]):
        r = run(sandbox, *cmd, env={"MINFER_CACHE": str(cache)})
        assert_clean(r, 1, "MINFER_CACHE", str(cache))
    assert reg.read_text() == "not a folder"


# ---- model files that lie ----------------------------------------------------------------

LIES = [
    ("block_count_1_of_2", dict(metadata={"qwen2.block_count": 1}), [], ["blk.1.attn_norm.weight", "not used"]),
    ("block_count_0", dict(metadata={"qwen2.block_count": 0}), [], ["qwen2.block_count", "out of range"]),
    ("extra_tensor", dict(extra_tensors={"blk.0.mystery.weight": (32, 4)}), [], ["blk.0.mystery.weight", "not used"]),
    ("rope_nan", dict(metadata={"qwen2.rope.freq_base": math.nan}), [], ["qwen2.rope.freq_base"]),
    ("rope_0", dict(metadata={"qwen2.rope.freq_base": 0.0}), [], ["qwen2.rope.freq_base"]),
    ("rope_neg", dict(metadata={"qwen2.rope.freq_base": -10000.0}), [], ["qwen2.rope.freq_base"]),
    ("eps_neg", dict(metadata={"qwen2.attention.layer_norm_rms_epsilon": -1e-6}), [], ["layer_norm_rms_epsilon"]),
    ("eps_nan", dict(metadata={"qwen2.attention.layer_norm_rms_epsilon": math.nan}), [], ["layer_norm_rms_epsilon"]),
    ("eps_inf", dict(metadata={"qwen2.attention.layer_norm_rms_epsilon": math.inf}), [], ["layer_norm_rms_epsilon"]),
    ("heads_0", dict(metadata={"qwen2.attention.head_count": 0}), [], ["qwen2.attention.head_count"]),
    ("ff_str", dict(metadata={"qwen2.feed_forward_length": "lots"}), [], ["qwen2.feed_forward_length", "not an integer"]),
    ("embd_float", dict(metadata={"qwen2.embedding_length": 64.0}), [], ["qwen2.embedding_length"]),
    ("ctx_0", dict(metadata={"qwen2.context_length": 0}), [], ["qwen2.context_length"]),
    ("no_arch", dict(metadata={"general.architecture": None}), [], ["no general.architecture"]),
]


@pytest.mark.parametrize("name,knobs,_,needles", LIES, ids=[x[0] for x in LIES])
def test_lying_model_is_refused_at_load(sb, tmp_path, name, knobs, _, needles):
    path = write_model(tmp_path / f"{name}.gguf", **knobs).path
    r = sb("generate", path, "hi", "-n", "2", "--temp", "0")
    assert_clean(r, 1, *needles)
    assert r.out == ""
    if name in ("rope_nan", "no_arch"):  # bench validates the file before its bandwidth probe
        r = sb("bench", path, "-p", "8", "-n", "2", "-r", "1")
        assert_clean(r, 1, *needles)


def test_overlapping_tensor_data_is_refused(sb, tmp_path):
    path = write_model(tmp_path / "overlap.gguf").path
    from minfer.io.gguf_file import GGUFFile

    with GGUFFile.open(path) as g:
        rel = g.tensors["blk.0.attn_q.weight"].offset - g.data_offset
    patch_tensor_offset(path, "blk.0.attn_k.weight", rel)
    r = sb("generate", path, "hi", "-n", "2")
    assert_clean(r, 1, "overlaps", "blk.0.attn_k.weight", "blk.0.attn_q.weight")
    assert_clean(sb("info", path), 1, "overlaps")


@pytest.mark.parametrize("which", ["nan", "inf"])
def test_non_finite_logits_stop_naming_the_step(sb, models, tmp_path, which):
    for extra in (["--temp", "0"], ["--temp", "0.8", "--seed", "1"], ["--temp", "0", "--repeat-penalty", "1.1"]):
        r = sb("generate", models[which], "hi", "-n", "4", "-t", "1", *extra)
        assert_clean(r, 1, "non-finite logits at the prompt (step 0)")
        assert r.out.strip() == ""  # no argmax of NaNs was printed
    text = tmp_path / "t.txt"
    text.write_text("the cat sat on the mat. " * 20)
    assert_clean(sb("perplexity", models[which], "-f", text, "--ctx", "16", "-t", "1"), 1, "non-finite logits at chunk 1",
                 max_lines=1)


# ---- signals and pipes -------------------------------------------------------------------

def _sigint_default() -> None:
    # A suite started in the background by a shell without job control inherits SIGINT
    # ignored, and Python keeps an ignored SIGINT ignored: give the child a terminal's
    # Ctrl-C, which is what these tests are about.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(sandbox, *args) -> subprocess.Popen:
    cwd, cache = sandbox
    env = dict(BASE_ENV, MINFER_CACHE=str(cache))
    return subprocess.Popen([MINFER, *map(str, args)], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_sigint_default)


def _read_until(p: subprocess.Popen, n_bytes: int, limit: float = TIMEOUT) -> bytes:
    got = b""
    deadline = time.monotonic() + limit
    while len(got) < n_bytes:
        assert time.monotonic() < deadline and p.poll() is None, ("ended or stalled early", p.poll(), got[-200:])
        chunk = os.read(p.stdout.fileno(), 4096)
        assert chunk, ("stdout closed early", p.wait(), p.stderr.read())
        got += chunk
    return got


def test_ctrl_c_during_generate_exits_130_with_whole_tokens(sandbox, models):
    long = ("generate", models["noeog"], "hello", "-n", "100000", "--ctx", "100010", "--temp", "0", "-t", "1")
    p = _start(sandbox, *long)
    try:
        head = _read_until(p, 64)
        p.send_signal(signal.SIGINT)
        rest, err = p.communicate(timeout=TIMEOUT)
    finally:
        p.kill()
    out = (head + rest).decode("utf-8")  # strict: no half-written multi-byte token
    err = err.decode()
    assert p.returncode == 130, err
    assert lines(err) == ["minfer: interrupted"], err
    # What was printed is exactly the start of the same greedy generation, uninterrupted.
    full = run(sandbox, *long[:3], "-n", "300", *long[5:])
    assert full.rc == 0
    ref = full.out.rstrip("\n")
    assert ref.startswith(out) or out.startswith(ref), (out[:200], ref[:200])
    assert len(out.encode()) >= 64


def test_ctrl_c_during_perplexity_exits_130(sandbox, models, tmp_path):
    text = tmp_path / "big.txt"
    text.write_text("the cat sat on the mat and the dog ate the hat. " * 20000)
    p = _start(sandbox, "perplexity", models["ok"], "-f", text, "--ctx", "16", "-t", "1")
    try:
        head = _read_until(p, 200)  # the header and the first running estimates
        p.send_signal(signal.SIGINT)
        rest, err = p.communicate(timeout=TIMEOUT)
    finally:
        p.kill()
    err = err.decode()
    assert p.returncode == 130, err
    assert lines(err) == ["minfer: interrupted"], err
    out = (head + rest).decode()
    assert out.startswith("perplexity:") and "[1]" in out and "Final estimate" not in out


def test_closed_stdout_is_not_a_traceback(sandbox, models):
    p = _start(sandbox, "generate", models["noeog"], "hello", "-n", "100000", "--ctx", "100010", "--temp", "0", "-t", "1")
    try:
        _read_until(p, 16)
        p.stdout.close()  # the reader goes away, as `minfer generate ... | head -c 16` does
        err = p.stderr.read().decode()
        p.wait(timeout=TIMEOUT)
    finally:
        p.kill()
    assert p.returncode == 141, err  # as if killed by SIGPIPE, like other Unix tools
    assert "Traceback" not in err and "Exception ignored" not in err, err


def test_bare_minfer_prints_help(sb):
    r = sb()
    assert_clean(r, 0, max_lines=0)
    assert "generate" in r.out and "perplexity" in r.out


# ---- fuzzing: random option values against an independent statement of the rules ---------

_finite_odd = st.sampled_from([0.0, -0.0, 1e-300, 5e-324, 1e300, 0.5, 1.0, 2.0, -1.0, 1e-7])
_float_text = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=64).map(repr),
    _finite_odd.map(repr),
    st.sampled_from(["nan", "-nan", "inf", "-inf", "1e999", "0x10", "1,5", "", "abc"]),
)
_int_text = st.one_of(
    st.integers(min_value=-(1 << 70), max_value=1 << 70).map(str),
    st.integers(min_value=-3, max_value=300).map(str),
    st.sampled_from(["", "1.5", "x", "0x10", "-0"]),
)
_OPTS = {
    "--temp": ("float", lambda v: v >= 0),
    "--top-p": ("float", lambda v: 0 < v <= 1),
    "--min-p": ("float", lambda v: 0 <= v < 1),
    "--repeat-penalty": ("float", lambda v: v > 0),
    "--top-k": ("int", lambda v: v >= 0),
    "--seed": ("int", lambda v: v == -1 or 0 <= v < (1 << 64)),
    "--threads": ("int", lambda v: v >= 1),
    "-n": ("int", lambda v: 0 <= v <= 8),  # larger -n is valid too but is left out of the fuzz for time
    "--ctx": ("int", lambda v: v == 0 or 32 <= v <= 4096),
}


def _parse_float(text: str) -> float | None:
    try:
        return float(text)  # what click's FLOAT does
    except ValueError:
        return None


def _parse_int(text: str) -> int | None:
    try:
        return int(text, 10)
    except ValueError:
        return None


def _valid(opt: str, text: str) -> bool:
    kind, rule = _OPTS[opt]
    v = _parse_float(text) if kind == "float" else _parse_int(text)
    if v is None or (kind == "float" and not math.isfinite(v)):
        return False
    return rule(v)


@st.composite
def _argvs(draw):
    chosen = draw(st.lists(st.sampled_from(sorted(_OPTS)), min_size=1, max_size=4, unique=True))
    pairs = []
    for opt in chosen:
        text = draw(_float_text if _OPTS[opt][0] == "float" else _int_text)
        if opt == "-n" and _parse_int(text) is not None and _parse_int(text) > 8:
            text = "8"
        if opt == "--ctx" and _parse_int(text) is not None and 0 < _parse_int(text) < 32:
            text = str(-_parse_int(text))  # tiny contexts fail for the prompt's sake, not the argument's
        if opt == "--ctx" and _parse_int(text) is not None and _parse_int(text) > 4096:
            text = draw(st.sampled_from([str(MAX_CTX + 1), str(1 << 40), "4096"]))
        pairs.append((opt, text))
    return pairs


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(pairs=_argvs())
def test_fuzzed_generate_options(tmp_path_factory, models, pairs):
    sandbox = tmp_path_factory.mktemp("fuzz-cwd"), tmp_path_factory.mktemp("fuzz-cache")
    argv = ["generate", models["noeog"], "hi"]
    if not any(o == "-n" for o, _ in pairs):
        argv += ["-n", "3"]
    if not any(o == "--threads" for o, _ in pairs):
        argv += ["--threads", "1"]  # one thread: quick even on a loaded machine
    for opt, text in pairs:
        argv.append(f"{'--n-predict' if opt == '-n' else opt}={text}")
    r = run(sandbox, *argv)
    expect = 0 if all(_valid(o, t) for o, t in pairs) else 2
    threads = [_parse_int(t) for o, t in pairs if o == "--threads" and _valid(o, t)]
    warn = 1 if threads and threads[0] > logical_cpus() else 0
    assert_clean(r, expect, max_lines=warn + 1)
    if expect == 2:
        assert r.out == ""
