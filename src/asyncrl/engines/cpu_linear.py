"""The hf engine's linear layers on the CPU in float32: a product of a few rows of our own.

A decode step multiplies a few dozen rows, or a few, by every weight of the model. torch
hands such a product to MKL, which packs the weight into blocks before it multiplies; at
a few dozen rows and fewer that is a large part of the product's time. This kernel reads
the weight once, as loaded (row-major ``[out, in]``), 14 of its rows at a time, and
multiplies them by all the input rows kept transposed in registers and L2 (AVX-512, 16
rows a vector), prefetching the next 14. Inside a shared run on a 2-core Intel Xeon with
AMX, SmolLM2-135M's fp32 decode steps of 5-16 rows took 1.2-1.3× less CPU time than
through MKL on column-major weights, those of 25-32 rows 1.03-1.10× less; and the
weights, as loaded, need no transposing copy at an update (bench/README, "A product of
our own").

Each output element is one chain of multiply-adds over the input features in order, so a
row's result does not depend on which other rows of a call of 4 to 32 it is computed with
(MKL's does, by its blocking).

Used for inference calls only (no autograd), of :data:`MIN_ROWS` to :data:`MAX_ROWS`
rows, in float32, on torch's single thread (with more threads MKL spreads a product over
them; this kernel does not). Everything else goes to ``F.linear`` unchanged. The C source
is compiled on first use with the system's C compiler for this CPU (``cc -O3
-march=native``) and cached under ``$XDG_CACHE_HOME/asyncrl`` (``~/.cache``), keyed by
the source and the CPU; where that cannot be done (no compiler, no AVX-512) the engine
says why once and keeps torch's products, with its weights column-major
(:func:`asyncrl.engines.hf.column_major_linears`). In bfloat16 torch's products (oneDNN,
with AMX where the CPU has it) are faster at these rows than a kernel of this kind
written with AVX512-BF16 (tried: 0.2-0.8× their speed), so a bfloat16 model keeps them.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from asyncrl.runtime.log import get_logger

log = get_logger(part="cpu-linear")

MIN_ROWS, MAX_ROWS = 4, 32
"""The rows of the products sent to the kernel. Fewer go to ``F.linear``: MKL's product of
one to three rows (a matrix-vector product, in effect) streams the weight faster than
this kernel, which multiplies 16 rows whatever it is given. More go there too: from 33
rows on MKL's packing pays (a product of 48-64 rows by this kernel took as long or
longer), and a prefill's product is larger still."""

SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX512F__)
#include <immintrin.h>

/* x^T of the call, [K][mp] with the rows zero-padded to mp (a multiple of 16): kept per
   thread, grown as needed. */
static __thread float *xt_buf;
static __thread size_t xt_cap;

static float *xt_get(size_t n) {
    if (n > xt_cap) {
        free(xt_buf);
        xt_buf = aligned_alloc(64, (n * sizeof(float) + 63) / 64 * 64);
        xt_cap = xt_buf ? n : 0;
    }
    return xt_buf;
}

/* One tile: weight rows n0..n0+MR-1 (of which `rows` exist) by the 16*NV input rows
   m0.. of x^T, each output one chain of multiply-adds over k in order. Prefetches
   `pfn` bytes at `pf` (the next tile) a line per k. Scatters the results to out[m, n]. */
#define TILE(MR, NV)                                                                     \
    static void tile_##MR##_##NV(const float *w, int64_t ws, int64_t K, const float *xt,  \
                                 int64_t mp, const float *bias, float *out, int64_t os,  \
                                 int64_t m0, int64_t mvalid, int rows, const char *pf,   \
                                 int64_t pfn) {                                          \
        __m512 acc[MR][NV];                                                              \
        const float *wr[MR];                                                             \
        for (int i = 0; i < MR; i++) {                                                   \
            for (int v = 0; v < NV; v++)                                                 \
                acc[i][v] = _mm512_set1_ps(bias && i < rows ? bias[i] : 0.0f);           \
            wr[i] = w + (int64_t)(i < rows ? i : 0) * ws;                                \
        }                                                                                \
        for (int64_t k = 0; k < K; k++) {                                                \
            if (k * 64 < pfn) _mm_prefetch(pf + k * 64, _MM_HINT_T0);                    \
            __m512 xv[NV];                                                               \
            for (int v = 0; v < NV; v++) xv[v] = _mm512_load_ps(xt + k * mp + m0 + 16 * v); \
            for (int i = 0; i < MR; i++) {                                               \
                __m512 a = _mm512_set1_ps(wr[i][k]);                                     \
                for (int v = 0; v < NV; v++) acc[i][v] = _mm512_fmadd_ps(a, xv[v], acc[i][v]); \
            }                                                                            \
        }                                                                                \
        __m512i idx = _mm512_mullo_epi32(                                                \
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),     \
            _mm512_set1_epi32((int)os));                                                 \
        for (int v = 0; v < NV; v++) {                                                   \
            int64_t left = mvalid - 16 * v;                                              \
            if (left <= 0) break;                                                        \
            __mmask16 mask = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);        \
            float *base = out + (m0 + 16 * v) * os;                                      \
            for (int i = 0; i < MR && i < rows; i++)                                     \
                _mm512_mask_i32scatter_ps(base + i, mask, idx, acc[i][v], 4);            \
        }                                                                                \
    }

TILE(14, 1)
TILE(14, 2)

int asyncrl_cpu_linear_lanes(void) { return 16; }

/* out[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]); x [M, K] rows xs apart, w [N, K] rows
   ws apart, out [M, N] rows os apart. 0 when done, < 0 when it cannot. */
int asyncrl_cpu_linear(const float *x, int64_t M, int64_t K, int64_t xs, const float *w,
                       int64_t N, int64_t ws, const float *bias, float *out, int64_t os) {
    if (M < 1 || K < 1 || N < 1 || os * 15 > INT32_MAX) return -1;
    int64_t mp = (M + 15) / 16 * 16;
    float *xt = xt_get((size_t)(K * mp));
    if (!xt) return -2;
    for (int64_t k = 0; k < K; k++) {
        float *row = xt + k * mp;
        for (int64_t m = 0; m < M; m++) row[m] = x[m * xs + k];
        for (int64_t m = M; m < mp; m++) row[m] = 0.0f;
    }
    for (int64_t m0 = 0; m0 < M; m0 += 32) { /* 32 rows a pass over the weight */
        int64_t chunk = M - m0 < 32 ? M - m0 : 32;
        for (int64_t n0 = 0; n0 < N; n0 += 14) {
            int rows = N - n0 < 14 ? (int)(N - n0) : 14;
            int64_t next = N - (n0 + 14);
            next = next < 0 ? 0 : next > 14 ? 14 : next;
            const char *pf = (const char *)(w + (n0 + 14) * ws);
            int64_t pfn = next * ws * (int64_t)sizeof(float);
            const float *b = bias ? bias + n0 : 0;
            const float *wt = w + n0 * ws;
            float *o = out + n0;
            if (chunk <= 16)
                tile_14_1(wt, ws, K, xt, mp, b, o, os, m0, chunk, rows, pf, pfn);
            else
                tile_14_2(wt, ws, K, xt, mp, b, o, os, m0, chunk, rows, pf, pfn);
        }
    }
    return 0;
}
#else
int asyncrl_cpu_linear_lanes(void) { return 0; }
int asyncrl_cpu_linear(const float *x, int64_t M, int64_t K, int64_t xs, const float *w,
                       int64_t N, int64_t ws, const float *bias, float *out, int64_t os) {
    return -3;
}
#endif
"""

_lock = threading.Lock()
_loaded: list[Callable[..., int] | None] = []
"""The kernel once loaded (or ``None`` where it cannot be), loaded at most once."""


def _cpu_key() -> str:
    """The CPU as far as the compiled code depends on it: model name and flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [
        line for line in text.splitlines() if line.startswith(("model name", "flags", "cpu family"))
    ]
    return "\n".join(sorted(set(keep)))


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "asyncrl" / "kernels"


def _build() -> Path:
    """The compiled library, from the cache or compiled now; raises with the reason."""
    if platform.machine() not in ("x86_64", "AMD64"):
        raise RuntimeError(
            f"the kernel is written for x86-64 with AVX-512, not {platform.machine()}"
        )
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    key = hashlib.sha256(f"{SOURCE}\n{compiler}\n{_cpu_key()}".encode()).hexdigest()[:16]
    target = _cache_dir() / f"cpu_linear-{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        source = Path(tmp) / "cpu_linear.c"
        source.write_text(SOURCE)
        built = Path(tmp) / target.name
        done = subprocess.run(
            [compiler, "-O3", "-march=native", "-shared", "-fPIC", "-o", str(built), str(source)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-500:]}")
        os.replace(built, target)  # whole or not at all, for another process reading it
    return target


def kernel() -> Callable[..., int] | None:
    """The kernel's entry point, compiled and loaded on the first call; ``None`` where it
    cannot run here (the reason logged once)."""
    with _lock:
        if not _loaded:
            fn: Callable[..., int] | None = None
            try:
                lib = ctypes.CDLL(str(_build()))
                if lib.asyncrl_cpu_linear_lanes() == 0:
                    raise RuntimeError("this CPU has no AVX-512")
                fn = lib.asyncrl_cpu_linear
                fn.restype = ctypes.c_int
                fn.argtypes = [
                    ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                    ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                    ctypes.c_void_p, ctypes.c_int64,
                ]  # fmt: skip
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                log.warning(
                    "the CPU decode kernel is not available: linear layers use torch's "
                    "products, with column-major weights",
                    reason=f"{type(exc).__name__}: {exc}"[:600],
                )
            _loaded.append(fn)
        return _loaded[0]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` by the kernel where it takes the call (see the module's
    docstring), else by torch."""
    fn = _loaded[0] if _loaded else None
    k = weight.shape[-1]
    rows = x.numel() // k if k else 0
    if (
        fn is None
        or not MIN_ROWS <= rows <= MAX_ROWS
        or x.dtype != torch.float32
        or weight.dtype != torch.float32
        or x.device.type != "cpu"
        or not weight.is_contiguous()
        or (bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()))
        or torch.is_grad_enabled()
        or torch.get_num_threads() != 1
    ):
        return F.linear(x, weight, bias)
    n = weight.shape[0]
    x2 = x.reshape(rows, k).contiguous()
    out = torch.empty(rows, n, dtype=torch.float32)
    code = fn(
        x2.data_ptr(), rows, k, k, weight.data_ptr(), n, k,
        None if bias is None else bias.data_ptr(), out.data_ptr(), n,
    )  # fmt: skip
    if code != 0:
        return F.linear(x, weight, bias)
    return out.view(*x.shape[:-1], n)


class DecodeLinear(torch.nn.Linear):
    """A ``torch.nn.Linear`` whose inference products of a few rows go to the kernel
    (:func:`linear`); its parameters and state dict are the Linear's."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return linear(input, self.weight, self.bias)


def install(model: Any) -> int:
    """Turns every float32 ``torch.nn.Linear`` of ``model`` on the CPU into a
    :class:`DecodeLinear` (the same object, its class changed) where the kernel can run
    here; returns how many (0 where it cannot, leaving the model as it was)."""
    linears = [
        m
        for m in model.modules()
        if type(m) is torch.nn.Linear
        and m.weight.dtype == torch.float32
        and m.weight.device.type == "cpu"
    ]
    if not linears or kernel() is None:
        return 0
    for m in linears:
        m.__class__ = DecodeLinear
    return len(linears)
