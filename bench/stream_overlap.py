"""Can one core stream memory and multiply at once? The question behind a decode step's
floor (bench/decode_floor.py).

    python bench/stream_overlap.py                 # 256 MB streamed, 0-64 multiply-adds a line
    python bench/stream_overlap.py --fmas 32

A decode step of R rows reads each weight once and multiplies it by all R rows: in fp32,
R vector multiply-adds of 16 lanes for every 64-byte cache line of weights. Its floor is
the larger of reading the bytes and doing the multiply-adds only if the core does both at
once; if it cannot, the step takes their sum. This measures that on the core it runs on,
free of any kernel's blocking choices: a small C loop (compiled here with ``cc -O3
-march=native``) reads a buffer far past the caches a line at a time, and after each line
issues F multiply-adds of 16 lanes on registers that do not depend on what was read, for
F in ``--fmas``. For each F it prints the bytes/s and FLOP/s reached and what the two
models predict from the stream alone (F = 0) and the multiply-adds alone (on a line kept
in L1):

- **overlapped**: the slower of the two, ``max(bytes / bandwidth, FLOPs / peak)``;
- **serial**: their sum, ``bytes / bandwidth + FLOPs / peak``;

and ``overlap``, where the measured time lies between them: 1 when it is the slower of
the two, 0 when it is their sum. F = 32 is an fp32 decode step of 32 rows (the long
workload's). One thread; a machine without a C compiler gets a clear error.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flops import cpu_line

LANES = 16
"""Lanes of a multiply-add here: 16 float32, one 64-byte cache line."""

SOURCE = r"""
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

typedef float v16 __attribute__((vector_size(64)));

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* Reads a[i & mask] a line at a time over n floats; after each line, F multiply-adds on
   16 accumulators that never depend on what was read. The best of reps passes. */
#define PASS(F)                                                                      \
    static double pass_##F(const float *a, size_t n, size_t mask, int reps, float *sink) { \
        v16 acc[16], s = {0};                                                        \
        const v16 c = (v16){0} + 0.999f;                                             \
        for (int j = 0; j < 16; j++) acc[j] = (v16){0} + (float)j;                   \
        double best = 1e30;                                                          \
        for (int r = 0; r < reps; r++) {                                             \
            double t = now();                                                        \
            for (size_t i = 0; i < n; i += 16) {                                     \
                s += *(const v16 *)(a + (i & mask));                                 \
                _Pragma("GCC unroll 64") for (int f = 0; f < F; f++)                 \
                    acc[f & 15] = acc[f & 15] * c + c;                               \
            }                                                                        \
            double d = now() - t;                                                    \
            if (d < best) best = d;                                                  \
        }                                                                            \
        for (int j = 0; j < 16; j++) s += acc[j];                                    \
        *sink += s[0] + s[15];                                                       \
        return best;                                                                 \
    }

PASS(0) PASS(4) PASS(8) PASS(16) PASS(24) PASS(32) PASS(48) PASS(64)

static double pass(int f, const float *a, size_t n, size_t mask, int reps, float *sink) {
    switch (f) {
    case 0: return pass_0(a, n, mask, reps, sink);
    case 4: return pass_4(a, n, mask, reps, sink);
    case 8: return pass_8(a, n, mask, reps, sink);
    case 16: return pass_16(a, n, mask, reps, sink);
    case 24: return pass_24(a, n, mask, reps, sink);
    case 32: return pass_32(a, n, mask, reps, sink);
    case 48: return pass_48(a, n, mask, reps, sink);
    case 64: return pass_64(a, n, mask, reps, sink);
    }
    return -1;
}

/* argv: megabytes (a power of two), reps, then the F values. Prints "F seconds" for the
   streamed passes, then "peak seconds" for F = 64 over a 16 KiB buffer n floats long. */
int main(int argc, char **argv) {
    size_t n = (size_t)atoi(argv[1]) << 18;
    int reps = atoi(argv[2]);
    float *a = aligned_alloc(64, n * sizeof(float)), sink = 0;
    if (!a) return 2;
    for (size_t i = 0; i < n; i++) a[i] = (float)(i % 1000) * 1e-3f;
    for (int k = 3; k < argc; k++) {
        int f = atoi(argv[k]);
        printf("%d %.9f\n", f, pass(f, a, n, n - 1, reps, &sink));
    }
    printf("peak %.9f\n", pass(64, a, n, 4095, reps, &sink));
    fprintf(stderr, "%g\n", sink);
    return 0;
}
"""

FMAS = (0, 4, 8, 16, 24, 32, 48, 64)
"""The multiply-adds a line the C loop is compiled for."""


def build(directory: Path) -> Path:
    """The probe compiled for this CPU into ``directory``."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise SystemExit("stream_overlap.py needs a C compiler (cc or gcc) on PATH")
    source = directory / "stream_overlap.c"
    source.write_text(SOURCE)
    binary = directory / "stream_overlap"
    subprocess.run(
        [compiler, "-O3", "-march=native", "-o", str(binary), str(source)],
        check=True,
        capture_output=True,
    )
    return binary


def measure(megabytes: int, reps: int, fmas: list[int]) -> tuple[dict[int, float], float]:
    """Seconds of the best pass for each F streamed over ``megabytes``, and of F = 64 over
    the same number of lines kept in L1 (the multiply-adds alone)."""
    with tempfile.TemporaryDirectory() as tmp:
        binary = build(Path(tmp))
        out = subprocess.run(
            [str(binary), str(megabytes), str(reps), *map(str, fmas)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    seconds: dict[int, float] = {}
    peak = 0.0
    for line in out.splitlines():
        key, value = line.split()
        if key == "peak":
            peak = float(value)
        else:
            seconds[int(key)] = float(value)
    return seconds, peak


def predict(nbytes: float, flops: float, bandwidth: float, peak: float) -> tuple[float, float]:
    """The seconds of reading ``nbytes`` and doing ``flops`` if the core does both at once
    (the slower of the two) and if it does one after the other (their sum)."""
    read, multiply = nbytes / bandwidth, flops / peak
    return max(read, multiply), read + multiply


def overlap(measured: float, overlapped: float, serial: float) -> float:
    """Where ``measured`` lies between the two predictions: 1 at ``overlapped``, 0 at
    ``serial`` (the same when they are equal, as with no multiply-adds)."""
    if serial <= overlapped:
        return 1.0
    return (serial - measured) / (serial - overlapped)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--megabytes", type=int, default=256, help="streamed; a power of two")
    ap.add_argument("--reps", type=int, default=3, help="passes; the best is taken")
    ap.add_argument("--fmas", type=int, nargs="+", default=list(FMAS), choices=FMAS)
    args = ap.parse_args()
    if args.megabytes & (args.megabytes - 1):
        raise SystemExit(f"--megabytes must be a power of two, not {args.megabytes}")
    fmas = sorted(set(args.fmas) | {0})
    seconds, peak_s = measure(args.megabytes, args.reps, fmas)
    lines = (args.megabytes << 20) // 64
    nbytes = float(args.megabytes << 20)
    bandwidth = nbytes / seconds[0]
    peak = lines * 64 * 2 * LANES / peak_s
    print(f"# {cpu_line()}, one thread; {args.megabytes} MB streamed, best of {args.reps}")
    print(
        f"# stream alone {bandwidth / 1e9:.1f} GB/s; multiply-adds alone"
        f" {peak / 1e9:.1f} GFLOP/s (a line in L1)"
    )
    print(
        f"{'FMAs/line':>9} {'GB/s':>6} {'GFLOP/s':>8} {'overlapped':>11} {'serial':>7}"
        f" {'measured':>9} {'overlap':>8}"
    )
    print(f"{'':>9} {'':>6} {'':>8} {'ms':>11} {'ms':>7} {'ms':>9} {'':>8}")
    for f in fmas:
        flops = float(lines * f * 2 * LANES)
        both, serial = predict(nbytes, flops, bandwidth, peak)
        s = seconds[f]
        print(
            f"{f:>9} {nbytes / s / 1e9:>6.1f} {flops / s / 1e9:>8.1f} {1e3 * both:>11.1f}"
            f" {1e3 * serial:>7.1f} {1e3 * s:>9.1f} {overlap(s, both, serial):>8.0%}",
            flush=True,
        )


if __name__ == "__main__":
    main()
