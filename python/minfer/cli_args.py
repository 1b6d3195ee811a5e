"""Argument rules of the command line, kept apart from cli.py's command wiring.

Every function either returns the value to use or raises click's UsageError, which
cli.main prints as one line and exits 2. The conventions follow llama.cpp where it
has one (--ctx 0 = the model's trained context, --seed -1 = random); threads are
refused when < 1 and capped (with a warning) at the logical CPUs, because more
threads than CPUs only makes the spinning barrier livelock.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

try:  # typer >= 0.20 vendors its own click; older ones use the real one
    from typer._click import exceptions as click_exc
except ImportError:  # pragma: no cover
    from click import exceptions as click_exc

from minfer.limits import MAX_CTX, logical_cpus

UsageError = click_exc.UsageError
MAX_SEED = (1 << 64) - 1


def number(name: str, value: float, lo: float | None = None, hi: float | None = None,
           lo_open: bool = False, hi_open: bool = False) -> float:
    """A finite float within [lo, hi] (open ends where asked)."""
    def rng() -> str:
        a = "-inf" if lo is None else f"{lo:g}"
        b = "inf" if hi is None else f"{hi:g}"
        return f"{'(' if lo_open or lo is None else '['}{a}, {b}{')' if hi_open or hi is None else ']'}"

    if not math.isfinite(value):
        raise UsageError(f"{name} must be a finite number in {rng()}, got {value}")
    if lo is not None and (value < lo or (lo_open and value == lo)):
        raise UsageError(f"{name} must be in {rng()}, got {value:g}")
    if hi is not None and (value > hi or (hi_open and value == hi)):
        raise UsageError(f"{name} must be in {rng()}, got {value:g}")
    return value


def integer(name: str, value: int, lo: int, hi: int | None = None, hint: str = "") -> int:
    if value < lo or (hi is not None and value > hi):
        want = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise UsageError(f"{name} must be {want}{hint}, got {value}")
    return value


def sampling(temp: float, top_k: int, top_p: float, min_p: float, repeat_penalty: float) -> None:
    number("--temp", temp, 0.0)
    integer("--top-k", top_k, 0, hint=" (0 = off)")
    number("--top-p", top_p, 0.0, 1.0, lo_open=True)
    number("--min-p", min_p, 0.0, 1.0, hi_open=True)
    number("--repeat-penalty", repeat_penalty, 0.0, lo_open=True)


def logit_bias(items: list[str]) -> tuple:
    """--logit-bias ID=BIAS (repeatable): ((id, bias), ...), ids >= 0 and biases in
    [-100, 100]; an id beyond the vocabulary is refused once the model is open."""
    out = {}
    for item in items:
        tid, sep, val = item.partition("=")
        try:
            t, b = int(tid), float(val)
        except ValueError:
            raise UsageError(f"--logit-bias takes ID=BIAS (e.g. 42=-100), got {item!r}") from None
        if not sep or t < 0:
            raise UsageError(f"--logit-bias takes ID=BIAS with a token id >= 0, got {item!r}")
        number("--logit-bias", b, -100.0, 100.0)
        out[t] = b
    return tuple(sorted(out.items()))


def seed(value: int | None) -> int | None:
    """--seed: -1 (or none) = a random seed, as in llama.cpp."""
    if value is None or value == -1:
        return None
    return integer("--seed", value, 0, MAX_SEED, hint=" or -1 (random)")


def ctx(value: int) -> int:
    """--ctx: 0 = the model's trained context (resolved once the model is loaded)."""
    return integer("--ctx", value, 0, MAX_CTX, hint=" (0 = the model's trained context)")


def threads(value: int | None, flag: str = "--threads") -> int | None:
    """None = the default (physical cores). < 1 is refused; above the logical CPUs is
    capped with a warning on stderr."""
    if value is None:
        return None
    integer(flag, value, 1, hint=" (leave it out for the default: physical cores)")
    cpus = logical_cpus()
    if value > cpus:
        sys.stderr.write(f"minfer: warning: {flag} {value} is more than the {cpus} logical CPUs here; using {cpus}\n")
        return cpus
    return value


def thread_list(values: list[int], flag: str = "-t") -> list[int]:
    out: list[int] = []
    for v in values:
        t = threads(v, flag)
        if t not in out:
            out.append(t)
    return out


def backends(value: str | None) -> list[str] | None:
    """--backend NAME[,NAME]: names are case-insensitive, as in MINFER_BACKENDS."""
    if value is None:
        return None
    names = [b.strip().lower() for b in value.split(",") if b.strip()]
    if not names:
        raise UsageError("--backend needs at least one name (cpu, cuda, metal)")
    return names


def output_path(flag: str, path: Path) -> Path:
    """A file we are about to create: its folder must exist and it must not be a folder."""
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise UsageError(f"{flag} {path} is a directory; give a file name")
    if not parent.is_dir():
        raise UsageError(f"{flag} {path}: the folder {parent} does not exist")
    if not os.access(parent, os.W_OK) and not path.exists():
        raise UsageError(f"{flag} {path}: the folder {parent} is not writable")
    return path


def text_file(flag: str, path: Path) -> str:
    """The UTF-8 text of an input file; anything else is a bad argument."""
    try:
        data = path.read_bytes()
    except IsADirectoryError:
        raise UsageError(f"{flag} {path} is a directory") from None
    except OSError as e:
        raise UsageError(f"{flag} {path}: {e.strerror or e}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"{flag} {path} is not UTF-8 text (invalid byte at offset {e.start})") from None


def model_file(path: Path) -> None:
    """Open and validate a model file (header, hyper-parameters, tensor table) without
    running it; raises the loader's MinferError (exit 1)."""
    from minfer.io.gguf_file import GGUFFile
    from minfer.models import load_model

    with GGUFFile.open(path) as g:
        load_model(g)
