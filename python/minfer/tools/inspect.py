"""`minfer info`: a readable summary of a GGUF model's header (nothing is computed)."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

from rich.console import Console
from rich.table import Table

from minfer.io.gguf_file import GGUFFile, TensorInfo

# Shown first and in this order; any other `<arch>.*` keys follow alphabetically.
HPARAM_KEYS = (
    "block_count", "context_length", "embedding_length", "feed_forward_length",
    "attention.head_count", "attention.head_count_kv", "attention.key_length",
    "attention.value_length", "rope.freq_base", "attention.layer_norm_rms_epsilon",
)
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.")


def human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    return f"{n} B"  # unreachable; keeps type checkers quiet


def _fmt(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return f"{v:,}" if abs(v) >= 10_000 else str(v)
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, str):
        return v if len(v) <= 60 else v[:57] + "..."
    try:
        n = len(v)
    except TypeError:
        return str(v)
    return f"[{n} items]" if n > 8 else str(list(v))


def _kv_table(title: str, rows: list[tuple[str, str]]) -> Table:
    t = Table(title=title, show_header=False, title_justify="left")
    t.add_column("key", style="bold")
    t.add_column("value")
    for k, v in rows:
        t.add_row(k, v)
    return t


def _token(tokens, i) -> str:
    if i is None:
        return "-"
    if tokens is not None and 0 <= int(i) < len(tokens):
        return f"{int(i)} {tokens[int(i)]!r}"
    return f"{int(i)} (out of range)"


def _tokenizer_rows(g: GGUFFile) -> list[tuple[str, str]]:
    m = g.metadata
    tokens = m.get("tokenizer.ggml.tokens")
    merges = m.get("tokenizer.ggml.merges")
    template = m.get("tokenizer.chat_template")
    rows = [
        ("model", str(m.get("tokenizer.ggml.model", "-"))),
        ("pre", str(m.get("tokenizer.ggml.pre", "-"))),
        ("vocab size", f"{len(tokens):,}" if tokens is not None else "-"),
        ("merges", f"{len(merges):,}" if merges is not None else "-"),
    ]
    for label, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("pad", "padding_token_id")):
        rows.append((label, _token(tokens, m.get(f"tokenizer.ggml.{key}"))))
    if "tokenizer.ggml.add_bos_token" in m:
        rows.append(("add bos", _fmt(m["tokenizer.ggml.add_bos_token"])))
    rows.append(("chat template", f"present ({len(template):,} chars)" if template else "absent"))
    return rows


def _shown_tensors(tensors: list[TensorInfo], all_tensors: bool) -> list[TensorInfo | str]:
    """Every tensor in file order, or a summary: the non-block tensors, then the first
    and last blocks with one line standing for the middle ones. Grouping by block
    number matters because converters often write blocks in lexicographic order."""
    if all_tensors:
        return list(tensors)
    by_block: dict[int, list[TensorInfo]] = defaultdict(list)
    out: list[TensorInfo | str] = []
    for t in tensors:
        m = _BLOCK_RE.match(t.name)
        if m:
            by_block[int(m.group(1))].append(t)
        else:
            out.append(t)
    if not by_block:
        return out
    ids = sorted(by_block)
    out += by_block[ids[0]]
    middle = ids[1:-1]
    if middle:
        n = sum(len(by_block[i]) for i in middle)
        out.append(f"... {n} tensors in blk.{middle[0]}-blk.{middle[-1]} (--all)")
    if len(ids) > 1:
        out += by_block[ids[-1]]
    return out


def print_info(path: str | Path, console: Console | None = None, all_tensors: bool = False) -> None:
    console = console or Console()
    with GGUFFile.open(path) as g:
        m = g.metadata
        arch = m.get("general.architecture", "?")
        tensors = list(g.tensors.values())
        total_bytes = sum(t.nbytes for t in tensors)
        total_params = sum(t.n_elements for t in tensors)

        console.print(_kv_table("Model", [
            ("file", str(g.path)),
            ("size", f"{human_bytes(g.file_size)} ({g.file_size:,} bytes)"),
            ("GGUF version", str(g.version)),
            ("architecture", str(arch)),
            ("name", str(m.get("general.name", "-"))),
            ("parameters", f"{total_params:,}"),
        ]))

        prefix = f"{arch}."
        present = [k for k in HPARAM_KEYS if prefix + k in m]
        extra = sorted(k[len(prefix):] for k in m if k.startswith(prefix) and k[len(prefix):] not in HPARAM_KEYS)
        console.print(_kv_table("Hyper-parameters", [(k, _fmt(m[prefix + k])) for k in present + extra]))

        console.print(_kv_table("Tokenizer", _tokenizer_rows(g)))

        tt = Table(title=f"Tensors ({len(tensors)})", title_justify="left")
        tt.add_column("name")
        tt.add_column("type")
        tt.add_column("shape")
        tt.add_column("bytes", justify="right")
        for t in _shown_tensors(tensors, all_tensors):
            if isinstance(t, str):
                tt.add_row(t, "", "", "", style="dim")
            else:
                tt.add_row(t.name, t.type_name, " x ".join(map(str, t.shape)), f"{t.nbytes:,}")
        console.print(tt)

        by_type: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
        for t in tensors:
            e = by_type[t.type_name]
            e[0] += 1
            e[1] += t.nbytes
            e[2] += t.n_elements
        ht = Table(title="By type", title_justify="left")
        ht.add_column("type")
        ht.add_column("tensors", justify="right")
        ht.add_column("bytes", justify="right")
        ht.add_column("parameters", justify="right")
        for name, (n, b, p) in sorted(by_type.items(), key=lambda kv: -kv[1][1]):
            ht.add_row(name, str(n), f"{b:,} ({human_bytes(b)})", f"{p:,}")
        ht.add_row("total", str(len(tensors)), f"{total_bytes:,} ({human_bytes(total_bytes)})",
                   f"{total_params:,}", style="bold")
        console.print(ht)
