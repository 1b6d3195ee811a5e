"""STREAM-style memory-bandwidth probe, the denominator of `minfer bench`'s "mem bw" column.

Usage:  python bench/stream.py [--threads N] [--mib SIZE] [--repeats R]

The measurement lives in minfer.tools.membw (bench/ is not shipped in the wheel, and
`minfer bench` needs it); this script only runs it and prints the numbers.
"""

from __future__ import annotations

import argparse

from minfer.tools.membw import measure, measure_bandwidth

__all__ = ["measure_bandwidth", "main"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None, help="worker threads (default: all CPUs)")
    ap.add_argument("--mib", type=int, default=None, help="bytes per array in MiB (default: >= 4x L3)")
    ap.add_argument("--repeats", type=int, default=5, help="report the best of this many passes")
    a = ap.parse_args(argv)
    rep = measure(n_threads=a.threads, array_bytes=a.mib << 20 if a.mib else None, repeats=a.repeats)
    print(f"threads {rep.n_threads}, {rep.array_bytes >> 20} MiB per array, best of {a.repeats}")
    print(f"copy   {rep.copy_bytes_per_s / 1e9:8.2f} GB/s")
    print(f"triad  {rep.triad_bytes_per_s / 1e9:8.2f} GB/s")
    print(f"read   {rep.read_bytes_per_s / 1e9:8.2f} GB/s")
    print(f"best   {rep.best / 1e9:8.2f} GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
