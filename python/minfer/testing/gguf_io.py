"""A GGUF's keys as (name, value, type, sub-type) and a file written from such keys and
a reader's tensors: what bench scripts and tests need to make a variant of an existing
file (another tokenizer, a changed key) without repeating gguf's field handling."""

from __future__ import annotations

from collections.abc import Iterable, Iterator


def fields(reader) -> Iterator[tuple]:
    """(name, value, value type, array sub-type or None) of every key of a
    gguf.GGUFReader but the header's (GGUF.*)."""
    import gguf

    for f in reader.fields.values():
        if f.name.startswith("GGUF."):
            continue
        vt = f.types[0]
        sub = f.types[1] if vt == gguf.GGUFValueType.ARRAY and len(f.types) > 1 else None
        yield f.name, f.contents(), vt, sub


def write(path, arch: str, keys: Iterable[tuple], tensors) -> None:
    """A GGUF of `keys` (as fields() gives them; general.architecture comes from arch)
    and the tensors of a reader, their bytes as they are."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    for name, value, vt, sub in keys:
        if name != "general.architecture":
            w.add_key_value(name, value, vt, sub_type=sub)
    for t in tensors:
        w.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
