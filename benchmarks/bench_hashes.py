"""Which hash the checksums feature records: throughput of the candidates, in one run.

For each candidate that is installed (``pip install crc32c google-crc32c`` adds the two
optional ones; xxhash is a dependency of this package): CPU throughput on a buffer too large
for any cache (``--mib``, from memory, as a save's tensors are) and on a 4 MiB buffer hashed
again and again (from the cache, as bytes just written are), the cost of one call on a
64-byte item, and whether it releases the GIL (the longest time another Python thread had
to wait while it hashed the large buffer, against the time the hash took: close to the
hash time means it holds the GIL). The checksums feature needs a fast hash that releases
the GIL (its writers hash each piece as they write it, several writer threads at once): see
megatron_ckpt_fixes/fixes/checksums/algorithms.py for the choice.

    python benchmarks/bench_hashes.py [--mib 512] [--repeats 5]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import statistics
import threading
import time
import zlib
from typing import Callable

CANDIDATES: dict[str, tuple[str | None, str]] = {  # name: (module needed, how it is called)
    "zlib.crc32 (records before xxh3)": (None, "zlib.crc32(b)"),
    "crc32c (ICRAR, SSE4.2 CRC-32C)": ("crc32c", "crc32c.crc32c(b)"),
    "google-crc32c": ("google_crc32c", "google_crc32c.extend(0, bytes(b)) (needs bytes)"),
    "xxhash xxh3_64 (recorded)": ("xxhash", "xxhash.xxh3_64_intdigest(b)"),
    "xxhash xxh3_128": ("xxhash", "xxhash.xxh3_128_intdigest(b)"),
    "hashlib sha256 (megatron-core's integrity.json)": (None, "hashlib.sha256(b).digest()"),
}


def _function(name: str) -> Callable[[memoryview], object]:
    if name.startswith("zlib"):
        return zlib.crc32
    if name.startswith("crc32c"):
        import crc32c

        return crc32c.crc32c
    if name.startswith("google"):
        import google_crc32c

        return lambda b: google_crc32c.extend(0, bytes(b))  # its C API takes bytes only
    if name.endswith("xxh3_128"):
        import xxhash

        return xxhash.xxh3_128_intdigest
    if name.startswith("xxhash"):
        import xxhash

        return xxhash.xxh3_64_intdigest
    return lambda b: hashlib.sha256(b).digest()


def _cpu_rate(fn: Callable[[memoryview], object], view: memoryview, times: int,
              repeats: int) -> float:
    """GiB/s of CPU time, median of ``repeats``."""
    rates = []
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(times):
            fn(view)
        rates.append(view.nbytes * times / (time.process_time() - start) / (1 << 30))
    return statistics.median(rates)


def _call_cost(fn: Callable[[memoryview], object], view: memoryview) -> float:
    """Microseconds per call on a 64-byte item."""
    small = view[:64]
    start = time.process_time()
    for _ in range(20000):
        fn(small)
    return (time.process_time() - start) / 20000 * 1e6


def _gil(fn: Callable[[memoryview], object], view: memoryview) -> tuple[float, float]:
    """(seconds the hash of ``view`` took, longest wait of another Python thread)."""
    done = threading.Event()
    took = [0.0]

    def run() -> None:
        start = time.perf_counter()
        fn(view)
        took[0] = time.perf_counter() - start
        done.set()

    thread = threading.Thread(target=run)
    last = time.perf_counter()
    longest = 0.0
    thread.start()
    while not done.is_set():
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    thread.join()
    return took[0], longest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512, help="size of the large buffer")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    large = memoryview(bytearray(os.urandom(1 << 20)) * args.mib)
    cached = large[:4 << 20]
    print(f"{args.mib} MiB from memory, 4 MiB from the cache (x64 per run), CPU time, median of "
          f"{args.repeats}; {os.cpu_count()} CPU(s)")
    print(f"{'candidate':50s} {'memory':>11s} {'cache':>11s} {'64 B call':>10s}  GIL while "
          "hashing the large buffer")
    for name, (module, call) in CANDIDATES.items():
        if module is not None and importlib.util.find_spec(module) is None:
            print(f"{name:50s} not installed ({call})")
            continue
        fn = _function(name)
        memory = _cpu_rate(fn, large, 1, args.repeats)
        cache = _cpu_rate(fn, cached, 64, args.repeats)
        took, waited = _gil(fn, large)
        verdict = "held" if waited > 0.5 * took else "released"
        print(f"{name:50s} {memory:6.2f} GiB/s {cache:6.2f} GiB/s {_call_cost(fn, large):7.2f} us"
              f"  {verdict} (hash {took * 1e3:.0f} ms, longest wait {waited * 1e3:.1f} ms)")


if __name__ == "__main__":
    main()
