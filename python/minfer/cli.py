"""The `minfer` command line. Each command is a thin shell over a module that does the
work; errors from those modules (MinferError) become one line on stderr and exit 1,
bad arguments exit 2 with one line."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

try:  # typer >= 0.20 vendors its own click; older ones use the real one
    from typer._click import exceptions as click_exc
    from typer._click import globals as click_globals
except ImportError:  # pragma: no cover
    from click import exceptions as click_exc
    from click import globals as click_globals

from minfer import __version__, cli_args
from minfer.errors import MinferError

app = typer.Typer(
    name="minfer",
    help="minfer: a local LLM inference engine (GGUF models on CPU and CUDA).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

ModelArg = Annotated[Optional[str], typer.Argument(help="GGUF file (default: the default model, pulled on first use)", show_default=False)]
ThreadsOpt = Annotated[Optional[int], typer.Option("--threads", "-t", help="CPU threads, >= 1 (default: physical cores; more than the logical CPUs is capped to them with a warning)")]
KvTypeOpt = Annotated[str, typer.Option("--kv-type", help="KV cache element type: f16 or f32 (exact; twice the memory).")]
BackendOpt = Annotated[Optional[str], typer.Option("--backend", help="Comma list of backends to use (cpu, cuda, metal; any case); default: all usable. Env: MINFER_BACKENDS, same syntax")]
# The sampling options generate and chat share.
TempOpt = Annotated[float, typer.Option("--temp", help="Temperature; 0 = greedy.")]
TopKOpt = Annotated[int, typer.Option("--top-k", help="Keep the k most likely tokens (0 = off).")]
TopPOpt = Annotated[float, typer.Option("--top-p", help="Nucleus sampling threshold (1 = off).")]
MinPOpt = Annotated[float, typer.Option("--min-p", help="Drop tokens below min_p x the top probability (0 = off).")]
RepeatPenaltyOpt = Annotated[float, typer.Option("--repeat-penalty", help="Penalty for recently seen tokens (1 = off).")]
PresenceOpt = Annotated[float, typer.Option("--presence-penalty", help="Subtract this from the logit of every token already generated, in [-2, 2] (0 = off).")]
FrequencyOpt = Annotated[float, typer.Option("--frequency-penalty", help="Subtract this times its count from the logit of a generated token, in [-2, 2] (0 = off).")]
LogitBiasOpt = Annotated[Optional[list[str]], typer.Option("--logit-bias", help="ID=BIAS: add BIAS (in [-100, 100]) to token ID's logit (repeatable).")]
LogprobsOpt = Annotated[Optional[int], typer.Option("--logprobs", help="Report each token's log-probability and its N most likely alternatives (0-20; with --json).")]
CTX0 = "0 = the model's trained context, as in llama.cpp"
SEED_HELP = "Random seed (same seed, same output); -1 = random, as in llama.cpp."
SeedOpt = Annotated[Optional[int], typer.Option("--seed", help=SEED_HELP)]
SpeculateOpt = Annotated[Optional[str], typer.Option("--speculate", help="Speculative decoding: ngram (prompt lookup) or draft (needs --draft-model).")]
DraftMaxOpt = Annotated[int, typer.Option("--draft-max", help="Most tokens drafted per verification (adaptive below that).")]
DraftModelOpt = Annotated[Optional[Path], typer.Option("--draft-model", help="GGUF of the draft model (same vocabulary) for --speculate draft.")]


def _version(value: bool) -> None:
    if value:
        typer.echo(f"minfer {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")] = False,
) -> None:
    """minfer: run GGUF language models locally."""


def _resolve_model(model: str | None) -> Path:
    from minfer.io.model_cache import default_model_path

    if model is None:
        return default_model_path(pull=True, progress=True)
    p = Path(model)
    if not p.exists():
        raise MinferError(f"model file not found: {model}")
    return p


def _split_model_and_text(args: list[str], what: str) -> tuple[str | None, str]:
    if len(args) == 1:
        return None, args[0]
    if len(args) == 2:
        return args[0], args[1]
    raise click_exc.UsageError(f"expected [MODEL] {what}, got {len(args)} arguments")


_backends = cli_args.backends


@app.command()
def pull(force: Annotated[bool, typer.Option("--force", help="Fetch again even if cached.")] = False) -> None:
    """Fetch, verify (sha256) and cache the default model."""
    from minfer.io.model_cache import pull as do_pull

    path = do_pull(progress=True, force=force)
    typer.echo(str(path))


@app.command()
def info(
    model: ModelArg = None,
    all_tensors: Annotated[bool, typer.Option("--all", help="List every tensor, not a summary.")] = False,
) -> None:
    """Architecture, hyper-parameters, tokenizer and tensors of a GGUF model."""
    from minfer.tools.inspect import print_info

    print_info(_resolve_model(model), all_tensors=all_tensors)


@app.command()
def tokenize(
    args: Annotated[list[str], typer.Argument(help="[MODEL] TEXT", show_default=False)],
    pieces: Annotated[bool, typer.Option("--pieces", help="Show each token's piece next to its id.")] = False,
) -> None:
    """Print the token ids of TEXT as a JSON list."""
    from minfer.tokenizer import Tokenizer, format_tokens

    model, text = _split_model_and_text(args, "TEXT")
    tok = Tokenizer.from_gguf_path(_resolve_model(model))
    typer.echo(format_tokens(tok, tok.encode(text), pieces=pieces))


@app.command()
def generate(
    args: Annotated[list[str], typer.Argument(help="[MODEL] PROMPT", show_default=False)],
    n_predict: Annotated[int, typer.Option("-n", "--n-predict", help="Tokens to generate.")] = 128,
    temp: TempOpt = 0.8,
    top_k: TopKOpt = 40,
    top_p: TopPOpt = 0.95,
    min_p: MinPOpt = 0.05,
    repeat_penalty: RepeatPenaltyOpt = 1.0,
    presence_penalty: PresenceOpt = 0.0,
    frequency_penalty: FrequencyOpt = 0.0,
    logit_bias: LogitBiasOpt = None,
    logprobs: LogprobsOpt = None,
    seed: SeedOpt = None,
    ctx: Annotated[int, typer.Option("--ctx", "-c", help=f"Context size in tokens ({CTX0}).")] = 4096,
    threads: ThreadsOpt = None,
    backend: BackendOpt = None,
    kv_type: KvTypeOpt = "f16",
    chat: Annotated[bool, typer.Option("--chat", help="Wrap PROMPT as a user message with the model's chat template.")] = False,
    echo: Annotated[bool, typer.Option("--echo", help="Also print the prompt.")] = False,
    stop: Annotated[Optional[list[str]], typer.Option("--stop", help="Stop when this string is generated (repeatable).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object at the end instead of streaming.")] = False,
    dump_graph: Annotated[Optional[Path], typer.Option("--dump-graph", help="Write the graph as Graphviz DOT and exit.")] = None,
    dump_graph_json: Annotated[Optional[Path], typer.Option("--dump-graph-json", help="Write the graph as minfer-graph JSON and exit.")] = None,
    decode: Annotated[bool, typer.Option("--decode", help="With --dump-graph(-json): dump the decode graph instead of prefill.")] = False,
    speculate: SpeculateOpt = None,
    draft_max: DraftMaxOpt = 8,
    draft_model: DraftModelOpt = None,
) -> None:
    """Generate a continuation of PROMPT, streamed to stdout; timings go to stderr."""
    model, prompt = _split_model_and_text(args, "PROMPT")
    cli_args.integer("-n", n_predict, 0)
    sp = _sampling(temp, top_k, top_p, min_p, repeat_penalty, seed, presence_penalty, frequency_penalty, logit_bias)
    if logprobs is not None:
        cli_args.integer("--logprobs", logprobs, 0, 20)
    cli_args.ctx(ctx)
    threads = cli_args.threads(threads)
    for flag, path in (("--dump-graph", dump_graph), ("--dump-graph-json", dump_graph_json)):
        if path is not None:
            cli_args.output_path(flag, path)
    t0 = time.perf_counter()
    session = _open_session(model, ctx, threads, backend, kv_type)
    spec = _speculation(session, speculate, draft_max, draft_model)
    # The weights get ready while the tokenizer is built (the graph dumps read the context).
    dumping = dump_graph is not None or dump_graph_json is not None
    warming = contextlib.nullcontext() if dumping else session.context.warming()
    with warming:
        tok = session.tokenizer
        text = tok.render_chat([{"role": "user", "content": prompt}], add_generation_prompt=True) if chat else prompt
        prompt_ids = tok.encode(text)
    if dump_graph is not None:
        _write_output(dump_graph, lambda: session.dump_graph(dump_graph, n_tokens=1 if decode else max(len(prompt_ids), 1),
                                                             decode=decode))
        typer.echo(f"wrote {'decode' if decode else 'prefill'} graph to {dump_graph}", err=True)
    if dump_graph_json is not None:
        from minfer.graph.export import write_graph_json

        doc = session.graph_json(n_tokens=1 if decode else max(len(prompt_ids), 1), decode=decode)
        _write_output(dump_graph_json, lambda: write_graph_json(doc, str(dump_graph_json)))
        typer.echo(f"wrote {doc['kind']} graph JSON ({len(doc['nodes'])} nodes) to {dump_graph_json}", err=True)
    if dump_graph is not None or dump_graph_json is not None:
        return
    session.check_fits(len(prompt_ids), n_predict)
    load_ms = (time.perf_counter() - t0) * 1000

    if echo and not as_json:
        _out(text)
    trace_path = os.environ.get("MINFER_TRACE", "")
    if trace_path:
        from minfer.tools.trace import Tracer

        session.context.tracer = Tracer(session.model_name, prompt=text)
    ids: list[int] = []
    parts: list[str] = []
    lps: list[dict] = []
    for ev in session.stream(prompt_ids, n_predict, sp, stop=stop or [], speculate=spec,
                             logprobs=False if logprobs is None else logprobs):
        if ev.text:
            parts.append(ev.text)
            if not as_json:
                _out(ev.text)
        if ev.done:
            reason, tm = ev.stop_reason, ev.timings
        else:
            ids.append(ev.id)
            if logprobs is not None:
                lps.append({"id": ev.id, "logprob": ev.logprob,
                            "top": [{"id": t, "logprob": lp} for t, lp in (ev.top_logprobs or [])]})
    if trace_path:
        tracer = session.context.tracer
        tracer.finish(ids, tok.decode)
        tracer.write(trace_path)
        typer.echo(f"wrote trace ({len(tracer.steps())} steps) to {trace_path}", err=True)
    stats = {"load_ms": round(load_ms, 2), **tm.as_dict()}
    if as_json:
        doc = {"text": "".join(parts), "ids": ids, "prompt_ids": prompt_ids, "stop_reason": reason, "timings": stats}
        if logprobs is not None:
            doc["logprobs"] = lps
        typer.echo(json.dumps(doc, ensure_ascii=False))
    else:
        _out("\n")
        typer.echo(
            f"load {stats['load_ms']:.0f} ms | prompt {stats['prompt_tokens']} tok, {stats['prompt_tps']:.1f} tok/s | "
            f"generated {stats['generated_tokens']} tok, {stats['gen_tps']:.1f} tok/s | stop: {reason}",
            err=True,
        )


def _out(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _sampling(temp: float, top_k: int, top_p: float, min_p: float, repeat_penalty: float, seed: int | None,
              presence: float = 0.0, frequency: float = 0.0, logit_bias: list[str] | None = None):
    from minfer.sampling import SamplingParams

    cli_args.sampling(temp, top_k, top_p, min_p, repeat_penalty)
    cli_args.number("--presence-penalty", presence, -2.0, 2.0)
    cli_args.number("--frequency-penalty", frequency, -2.0, 2.0)
    return SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p,
                          repeat_penalty=repeat_penalty, seed=cli_args.seed(seed), presence_penalty=presence,
                          frequency_penalty=frequency, logit_bias=cli_args.logit_bias(logit_bias or []))


def _write_output(path: Path, write) -> None:
    existed = path.exists()
    try:
        write()
    except OSError as e:
        # Leave nothing half-written behind where there was nothing before.
        if not existed and path.is_file():
            path.unlink(missing_ok=True)
        raise MinferError(f"could not write {path}: {e.strerror or e}") from None


def _given(param: str) -> bool:
    """Whether the user set this option (a default above a small model's trained
    context is not worth a warning; an explicit --ctx is)."""
    c = click_globals.get_current_context(silent=True)
    src = c.get_parameter_source(param) if c is not None else None
    return src is None or src.name not in ("DEFAULT", "DEFAULT_MAP")


def _kv_type(kv_type: str) -> str:
    from minfer.graph.params import KV_TYPES

    if kv_type not in KV_TYPES:
        raise click_exc.UsageError(f"--kv-type must be one of {', '.join(KV_TYPES)}, not {kv_type!r}")
    return kv_type


def _speculation(session, mode: str | None, draft_max: int, draft_model: Path | None):
    if mode is None:
        if draft_model is not None:
            raise click_exc.UsageError("--draft-model needs --speculate draft")
        return None
    if mode not in ("ngram", "draft"):
        raise click_exc.UsageError(f"--speculate must be ngram or draft, not {mode!r}")
    if not 1 <= draft_max <= 64:
        raise click_exc.UsageError(f"--draft-max must be in [1, 64], got {draft_max}")
    if (mode == "draft") != (draft_model is not None):
        raise click_exc.UsageError("--speculate draft needs --draft-model PATH (and only it takes one)")
    if draft_model is not None and not draft_model.is_file():
        raise MinferError(f"draft model file not found: {draft_model}")
    from minfer.speculate import Speculation

    return Speculation.open(mode, draft_max=draft_max, draft_model_path=draft_model, target=session.model)


def _open_session(model: str | None, ctx: int, threads: int | None, backend: str | None, kv_type: str = "f16"):
    from minfer.session import Session

    kv_type = _kv_type(kv_type)
    session = Session.open(_resolve_model(model), n_ctx=ctx, n_threads=threads, backends=_backends(backend),
                           kv_type=kv_type)
    n_train = session.hp.n_ctx_train
    if ctx > n_train and _given("ctx"):
        typer.echo(f"minfer: warning: --ctx {ctx} is above the model's trained context ({n_train}); quality may "
                   f"degrade past {n_train} tokens", err=True)
    return session


@app.command()
def chat(
    model: ModelArg = None,
    n_predict: Annotated[int, typer.Option("-n", "--n-predict", help="Most tokens per reply.")] = 512,
    temp: TempOpt = 0.8,
    top_k: TopKOpt = 40,
    top_p: TopPOpt = 0.95,
    min_p: MinPOpt = 0.05,
    repeat_penalty: RepeatPenaltyOpt = 1.0,
    presence_penalty: PresenceOpt = 0.0,
    frequency_penalty: FrequencyOpt = 0.0,
    logit_bias: LogitBiasOpt = None,
    seed: SeedOpt = None,
    ctx: Annotated[int, typer.Option("--ctx", "-c", help=f"Context size in tokens, the whole conversation ({CTX0}).")] = 4096,
    threads: ThreadsOpt = None,
    backend: BackendOpt = None,
    kv_type: KvTypeOpt = "f16",
    system: Annotated[Optional[str], typer.Option("--system", help="A system message to start the conversation.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per turn instead of streamed text.")] = False,
    session_path: Annotated[Optional[Path], typer.Option("--session", help="Resume the conversation saved in FILE (if it exists) and save it after each turn.")] = None,
    session_reset: Annotated[bool, typer.Option("--session-reset", help="With --session: start clean, ignoring what FILE holds.")] = False,
    speculate: SpeculateOpt = None,
    draft_max: DraftMaxOpt = 8,
    draft_model: DraftModelOpt = None,
) -> None:
    """Chat with the model, one turn per line; the KV is kept between turns, so each
    turn processes only its new tokens. `/reset` starts over. When stdin is not a
    terminal, each line of stdin is one user turn."""
    cli_args.integer("-n", n_predict, 1)
    sp = _sampling(temp, top_k, top_p, min_p, repeat_penalty, seed, presence_penalty, frequency_penalty, logit_bias)
    cli_args.ctx(ctx)
    threads = cli_args.threads(threads)
    if session_reset and session_path is None:
        raise click_exc.UsageError("--session-reset needs --session FILE")
    session = _open_session(model, ctx, threads, backend, kv_type)
    spec = _speculation(session, speculate, draft_max, draft_model)
    with session.context.warming():  # the weights get ready while the tokenizer is built
        tok = session.tokenizer
    start = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    if session_path is not None and session_path.exists() and not session_reset:
        # A file that does not fit (another model, --ctx, corrupted) is an error: the
        # user asked for that conversation; --session-reset starts over instead.
        meta = session.restore(session_path)
        saved = meta.get("messages")
        if not isinstance(saved, list):
            raise MinferError(f"session file {session_path} holds no chat messages")
        messages = saved
    tty = sys.stdin.isatty()
    while True:
        if tty:
            sys.stderr.write("> ")
            sys.stderr.flush()
        line = sys.stdin.readline()
        if not line:
            break
        line = line.rstrip("\n")
        if line.strip() == "/reset":
            messages = list(start)
            session.reset()
            if session_path is not None:
                session.save(session_path, meta={"messages": messages})
            if tty:
                sys.stderr.write("(conversation reset)\n")
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        prompt_ids = tok.encode(tok.render_chat(messages, add_generation_prompt=True))
        ids: list[int] = []
        parts: list[str] = []
        for ev in session.stream(prompt_ids, n_predict, sp, speculate=spec):
            if ev.text:
                parts.append(ev.text)
                if not as_json:
                    _out(ev.text)
            if ev.done:
                reason, tm = ev.stop_reason, ev.timings
            else:
                ids.append(ev.id)
        reply = "".join(parts)
        messages.append({"role": "assistant", "content": reply})
        if session_path is not None:
            session.save(session_path, meta={"messages": messages})
        if as_json:
            typer.echo(json.dumps({"text": reply, "ids": ids, "prompt_tokens": tm.prompt_tokens,
                                   "cached_tokens": tm.cached_tokens, "stop_reason": reason,
                                   "timings": tm.as_dict()}, ensure_ascii=False))
        else:
            _out("\n")
            if tty:
                sys.stderr.write(f"[{tm.prompt_tokens - tm.cached_tokens} new prompt tok, {tm.cached_tokens} cached, "
                                 f"{tm.generated_tokens} tok at {tm.gen_tps:.1f} tok/s]\n")


@app.command()
def perplexity(
    model: ModelArg = None,
    file: Annotated[Path, typer.Option("-f", "--file", help="UTF-8 text file to score.")] = ...,  # type: ignore[assignment]
    ctx: Annotated[int, typer.Option("--ctx", "-c", help=f"Chunk size in tokens ({CTX0}).")] = 512,
    threads: ThreadsOpt = None,
    backend: BackendOpt = None,
    kv_type: KvTypeOpt = "f16",
    max_chunks: Annotated[int, typer.Option("--chunks", help="Score at most this many chunks, >= 0 (0 = all).")] = 0,
) -> None:
    """Perplexity over FILE the way llama.cpp's perplexity tool computes it."""
    cli_args.ctx(ctx)
    cli_args.integer("--chunks", max_chunks, 0, hint=" (0 = all)")
    threads = cli_args.threads(threads)
    text = cli_args.text_file("-f", file)
    from minfer.tools.perplexity import run_perplexity

    session = _open_session(model, ctx, threads, backend, kv_type)
    run_perplexity(session, text, session.n_ctx, max_chunks=max_chunks, out=lambda s: typer.echo(s))


@app.command()
def bench(
    model: ModelArg = None,
    n_prompt: Annotated[str, typer.Option("-p", "--n-prompt", help="Prompt sizes, comma list.")] = "512",
    n_gen: Annotated[str, typer.Option("-n", "--n-gen", help="Generation lengths, comma list.")] = "128",
    n_depth: Annotated[str, typer.Option("-d", "--n-depth", help="Tokens already in the context when each test starts (prefilled, untimed), comma list.")] = "0",
    reps: Annotated[int, typer.Option("-r", "--repetitions", help="Repetitions per test.")] = 5,
    threads: Annotated[Optional[str], typer.Option("-t", "--threads", help="Thread counts, comma list, each >= 1 (capped at the logical CPUs with a warning).")] = None,
    backend: BackendOpt = None,
    kv_type: KvTypeOpt = "f16",
    output: Annotated[str, typer.Option("-o", "--output", help="md, json or csv.")] = "md",
    speculate: Annotated[Optional[str], typer.Option("--speculate", help="Speculative mode: tgN on a code-editing prompt, plain and with this drafter (ngram or draft), side by side.")] = None,
    draft_max: DraftMaxOpt = 8,
    draft_model: DraftModelOpt = None,
) -> None:
    """Measure prompt processing (pp) and text generation (tg) speed, llama-bench style."""
    if output not in ("md", "json", "csv"):
        raise click_exc.UsageError(f"-o must be md, json or csv, not {output!r}")
    if reps < 1:
        raise click_exc.UsageError("-r must be >= 1")
    from minfer.tools.bench import format_results, parse_int_list, run_bench
    from minfer.backends import default_threads

    try:
        pp, tg, depth = parse_int_list(n_prompt), parse_int_list(n_gen), parse_int_list(n_depth)
    except ValueError as e:
        raise click_exc.UsageError(str(e)) from None
    try:
        th = [int(t) for t in threads.split(",") if t.strip()] if threads else [default_threads()]
    except ValueError:
        raise click_exc.UsageError(f"-t expects a comma list of thread counts, got {threads!r}") from None
    if not th:
        raise click_exc.UsageError("-t needs at least one thread count")
    th = cli_args.thread_list(th, "-t")
    names = _backends(backend)
    kv_type = _kv_type(kv_type)
    path = _resolve_model(model)
    cli_args.model_file(path)  # a bad file fails now, not after the bandwidth probe
    if speculate is not None:
        from minfer.tools.bench import run_spec_bench

        if speculate not in ("ngram", "draft") or (speculate == "draft") != (draft_model is not None):
            raise click_exc.UsageError("--speculate must be ngram, or draft with --draft-model PATH")
        if not 1 <= draft_max <= 64:
            raise click_exc.UsageError(f"--draft-max must be in [1, 64], got {draft_max}")
        results = run_spec_bench(path, n_gen=tg, reps=reps, threads=th, backends=names,
                                 mode=speculate, draft_max=draft_max, draft_model=draft_model, kv_type=kv_type,
                                 progress=lambda s: typer.echo(s, err=True))
        typer.echo(format_results(results, output))
        return
    results = run_bench(path, n_prompt=pp, n_gen=tg, reps=reps, threads=th, n_depth=depth,
                        backends=names, progress=lambda s: typer.echo(s, err=True), kv_type=kv_type)
    typer.echo(format_results(results, output))


@app.command()
def quantize(
    input_path: Annotated[Path, typer.Argument(metavar="IN.gguf", help="Model to quantize: F32, F16 or BF16 (a quantized one is requantized, with a warning).", show_default=False)],
    output_path: Annotated[Path, typer.Argument(metavar="OUT.gguf", help="File to write (atomically: a temporary file beside it, renamed when complete).", show_default=False)],
    qtype: Annotated[str, typer.Argument(metavar="TYPE", help="Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K_S Q4_K_M Q5_K_S Q5_K_M Q6_K F16 BF16 (llama.cpp's names).", show_default=False)],
    threads: Annotated[Optional[int], typer.Option("--threads", "-t", help="Threads (default: all logical CPUs, as llama-quantize).")] = None,
    pure: Annotated[bool, typer.Option("--pure", help="Every 2-D weight the base type: no per-tensor mix (rows that are not whole blocks still fall back).")] = False,
    output_type: Annotated[Optional[str], typer.Option("--output-type", help="Tensor type of output.weight (F32 F16 BF16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K Q5_K Q6_K).")] = None,
    token_embedding_type: Annotated[Optional[str], typer.Option("--token-embedding-type", help="Tensor type of token_embd.weight (same choices).")] = None,
    keep_split_metadata: Annotated[bool, typer.Option("--keep-split-metadata", help="Keep split.* keys (llama.cpp drops them).")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan (tensor, shape, from-type, to-type) and write nothing.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Overwrite OUT if it exists.")] = False,
) -> None:
    """Quantize a GGUF model to TYPE the way llama.cpp's llama-quantize does (same mixes, same bytes)."""
    from minfer.tools.quantize import parse_ftype, parse_tensor_type, quantize_file

    try:
        ftype = parse_ftype(qtype)
        otype = parse_tensor_type(output_type, "--output-type") if output_type is not None else None
        etype = parse_tensor_type(token_embedding_type, "--token-embedding-type") if token_embedding_type is not None else None
    except ValueError as e:
        raise click_exc.UsageError(str(e)) from None
    threads = cli_args.threads(threads)
    quantize_file(input_path, output_path, ftype, n_threads=threads, pure=pure, output_type=otype,
                  token_embedding_type=etype, keep_split_metadata=keep_split_metadata, dry_run=dry_run, force=force,
                  echo=typer.echo)


trace_app = typer.Typer(help="Work with MINFER_TRACE files.", no_args_is_help=True)
app.add_typer(trace_app, name="trace")


@trace_app.command("diff")
def trace_diff(
    a: Annotated[Path, typer.Argument(help="First trace (MINFER_TRACE output).", show_default=False)],
    b: Annotated[Path, typer.Argument(help="Second trace.", show_default=False)],
    tol: Annotated[float, typer.Option("--tol", help="Largest |a-b| (values or stats) that still counts as equal.")] = 0.0,
) -> None:
    """First node where two traces differ beyond --tol, then a per-layer summary."""
    from minfer.tools.trace import load_trace
    from minfer.tools.trace_diff import diff_traces, format_report

    if not tol >= 0:
        raise click_exc.UsageError(f"--tol must be >= 0, got {tol}")
    rep = diff_traces(load_trace(str(a)), load_trace(str(b)), tol)
    typer.echo(format_report(rep, a.name, b.name))


@app.command()
def profile(
    args: Annotated[list[str], typer.Argument(help="[MODEL] PROMPT", show_default=False)],
    n_predict: Annotated[int, typer.Option("-n", "--n-predict", help="Decode steps to time after the prefill.")] = 16,
    ctx: Annotated[int, typer.Option("--ctx", "-c", help=f"Context size in tokens ({CTX0}).")] = 4096,
    threads: ThreadsOpt = None,
    backend: BackendOpt = None,
    kv_type: KvTypeOpt = "f16",
    top: Annotated[int, typer.Option("--top", help="Nodes listed per phase (0 = all).")] = 25,
    as_json: Annotated[bool, typer.Option("--json", help="Print the minfer-profile JSON (for minfer viz --profile).")] = False,
) -> None:
    """Per-node and per-op time of prefill and decode, sorted by time, with matmul GB/s
    (on CUDA per kernel launch, merged launches included, timed with CUDA events)."""
    model, prompt = _split_model_and_text(args, "PROMPT")
    if n_predict < 1:
        raise click_exc.UsageError("-n must be >= 1")
    if top < 0:
        raise click_exc.UsageError("--top must be >= 0")
    cli_args.ctx(ctx)
    threads = cli_args.threads(threads)
    from minfer.tools.profile import format_profile, run_profile

    session = _open_session(model, ctx, threads, backend, kv_type)
    ids = session.tokenizer.encode(prompt)
    session.check_fits(len(ids), n_predict)
    doc = run_profile(session, ids, n_predict, prompt)
    typer.echo(json.dumps(doc) if as_json else format_profile(doc, top))


@app.command()
def viz(
    model: ModelArg = None,
    port: Annotated[int, typer.Option("--port", help="Loopback port to serve on.")] = 8081,
    trace: Annotated[Optional[Path], typer.Option("--trace", help="Open this MINFER_TRACE file in the page.")] = None,
    profile_file: Annotated[Optional[Path], typer.Option("--profile", help="Colour nodes by this minfer-profile JSON.")] = None,
    ctx: Annotated[int, typer.Option("--ctx", "-c", help="Context size for live runs.")] = 512,
    kv_type: KvTypeOpt = "f16",
    threads: ThreadsOpt = None,
    backend: BackendOpt = None,
) -> None:
    """Serve the graph page (loopback only): graph, live per-node data, traces and profiles."""
    if not 0 < port < 65536:
        raise click_exc.UsageError(f"--port must be in 1..65535, got {port}")
    cli_args.ctx(ctx)
    threads = cli_args.threads(threads)
    from minfer.tools.viz.server import serve

    serve(_resolve_model(model), port=port, trace=trace, profile=profile_file, n_ctx=ctx, n_threads=threads,
          backends=_backends(backend), kv_type=_kv_type(kv_type))


@app.command()
def serve(
    model: ModelArg = None,
    host: Annotated[str, typer.Option("--host", help="Address to bind (loopback unless told otherwise).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="TCP port.")] = 8080,
    slots: Annotated[int, typer.Option("--slots", help="Concurrent conversations (sequences of one KV arena).")] = 4,
    ctx: Annotated[int, typer.Option("--ctx", "-c", help="Context size per slot, in tokens.")] = 4096,
    kv_cells: Annotated[Optional[int], typer.Option("--kv-cells", help="KV cells (tokens) all slots share: a request takes its prompt plus max_tokens of them while it runs, and waits when they are taken. Default: --ctx for every slot.")] = None,
    threads: ThreadsOpt = None,
    backend: BackendOpt = None,
    api_key: Annotated[Optional[str], typer.Option("--api-key", help="Require 'Authorization: Bearer KEY' (or 'x-api-key: KEY'). Env: MINFER_API_KEY", envvar="MINFER_API_KEY")] = None,
    max_queue: Annotated[int, typer.Option("--max-queue", help="Requests that may wait for a slot; more get 503.")] = 64,
    speculate: Annotated[Optional[str], typer.Option("--speculate", help="Default for requests that do not say: ngram (prompt lookup), draft (needs --draft-model) or off. A request overrides it with \"speculate\": \"ngram\" | \"draft\" | \"off\".")] = None,
    draft_max: DraftMaxOpt = 8,
    draft_model: Annotated[Optional[Path], typer.Option("--draft-model", help="GGUF of a draft model (same vocabulary): requests may then speculate with \"speculate\": \"draft\".")] = None,
    models_dir: Annotated[Optional[Path], typer.Option("--models-dir", help="Serve every *.gguf in DIR behind one endpoint: /v1/models lists them, a request's \"model\" picks one, loaded on its first request.")] = None,
    more_models: Annotated[Optional[list[Path]], typer.Option("--model", "-m", help="A GGUF to serve among several (repeat it; with or instead of --models-dir).")] = None,
    models_max: Annotated[int, typer.Option("--models-max", help="Models loaded at once with --models-dir / --model; past it the least recently used idle one is unloaded.")] = 1,
) -> None:
    """Serve models over an OpenAI-compatible HTTP API (chat and completions with tools
    and structured output, responses, Anthropic messages, embeddings; streaming by
    server-sent events) with slots and continuous batching."""
    from minfer.model import Model
    from minfer.server import ServeConfig, serve as run_server

    if not 0 < port < 65536:
        raise click_exc.UsageError(f"--port must be in 1..65535, got {port}")
    if slots < 1 or ctx < 1 or max_queue < 0:
        raise click_exc.UsageError("--slots and --ctx must be >= 1, --max-queue >= 0")
    if kv_cells is not None and not ctx <= kv_cells <= ctx * slots:
        raise click_exc.UsageError(f"--kv-cells must be in [--ctx, --ctx x --slots] = [{ctx}, {ctx * slots}], "
                                   f"got {kv_cells}")
    if speculate not in (None, "ngram", "draft", "off"):
        raise click_exc.UsageError(f"--speculate must be ngram, draft or off, not {speculate!r}")
    if speculate == "draft" and draft_model is None:
        raise click_exc.UsageError("--speculate draft needs --draft-model PATH")
    if draft_model is not None and not draft_model.is_file():
        raise MinferError(f"draft model file not found: {draft_model}")
    if not 1 <= draft_max <= 64:
        raise click_exc.UsageError(f"--draft-max must be in [1, 64], got {draft_max}")
    if models_max < 1:
        raise click_exc.UsageError(f"--models-max must be >= 1, got {models_max}")
    threads = cli_args.threads(threads)
    paths: list[Path] = []
    if models_dir is not None:
        if not models_dir.is_dir():
            raise MinferError(f"--models-dir: not a directory: {models_dir}")
        paths += sorted(p for p in models_dir.iterdir() if p.suffix.lower() == ".gguf" and p.is_file())
        if not paths:
            raise MinferError(f"--models-dir: no .gguf files in {models_dir}")
    for p in more_models or []:
        if not p.is_file():
            raise MinferError(f"model file not found: {p}")
        paths.append(p)
    if model is not None and paths:
        paths.insert(0, _resolve_model(model))
    cfg = ServeConfig(host=host, port=port, slots=slots, ctx=ctx, kv_cells=kv_cells, api_key=api_key or None,
                      max_queue=max_queue,
                      speculate=None if speculate == "off" else speculate, draft_max=draft_max,
                      backends=_backends(backend), threads=threads)
    if paths:
        if draft_model is not None:
            raise click_exc.UsageError("--draft-model serves one model; it cannot be combined with several")
        cfg.models, cfg.models_max = paths, models_max
        run_server(None, cfg)
        return
    m = Model.open(_resolve_model(model), backends=_backends(backend), n_threads=threads)
    cfg.draft_model = Model.open(draft_model, backends=_backends(backend), n_threads=threads) \
        if draft_model is not None else None
    run_server(m, cfg)


def _rewrite_top_level_dump_graph(argv: list[str]) -> list[str]:
    # `minfer --dump-graph g.dot [MODEL] PROMPT` is the documented spelling; it is
    # `generate --dump-graph ...` underneath.
    if argv and argv[0].startswith("--dump-graph"):
        return ["generate", *argv]
    return argv


def _invoke(argv: list[str]) -> int:
    """Parse and run one command. Click is driven directly (not through app(), whose
    own handlers turn Ctrl-C into a return value and a broken pipe into exit 1), so
    every exception reaches main's handlers as itself."""
    cmd = typer.main.get_command(app)
    with cmd.make_context("minfer", argv) as ctx:
        cmd.invoke(ctx)
    return 0


def _quiet_stdout() -> None:
    # The reader of stdout is gone: point fd 1 at /dev/null so the interpreter's final
    # flush cannot raise a second BrokenPipeError at exit.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def _flush_stdout() -> None:
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        _quiet_stdout()
    except (OSError, ValueError):
        pass


def _isatty(f) -> bool:
    try:
        return f.isatty()
    except (AttributeError, ValueError):
        return False


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 ok, 1 error, 2 bad arguments, 130 interrupted (Ctrl-C),
    141 stdout closed by its reader (as a process killed by SIGPIPE)."""
    argv = _rewrite_top_level_dump_graph(list(sys.argv[1:] if argv is None else argv))
    try:
        return _invoke(argv)
    except click_exc.NoArgsIsHelpError as e:
        # Bare `minfer` prints help, as with --help.
        typer.echo(e.ctx.get_help() if e.ctx else "")
        return 0
    except click_exc.UsageError as e:
        msg = e.format_message().replace("\n", " ")
        sys.stderr.write(f"minfer: error: {msg} (see 'minfer --help')\n")
        return 2
    except typer.Exit as e:
        return int(getattr(e, "exit_code", 0) or 0)
    except typer.Abort:
        sys.stderr.write("minfer: interrupted\n")
        return 130
    except click_exc.ClickException as e:
        sys.stderr.write(f"minfer: error: {e.format_message()}\n")
        return 1
    except MinferError as e:
        _flush_stdout()
        sys.stderr.write(f"minfer: error: {e}\n")
        return 1
    except KeyboardInterrupt:
        # A second Ctrl-C while we report the first must not print a traceback.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _flush_stdout()  # whatever whole tokens were written are kept
        sys.stderr.write(("\n" if _isatty(sys.stderr) else "") + "minfer: interrupted\n")
        return 130
    except BrokenPipeError:
        _quiet_stdout()
        return 141


if __name__ == "__main__":
    raise SystemExit(main())
