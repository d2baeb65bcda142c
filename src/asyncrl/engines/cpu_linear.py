"""The hf engine's linear layers on the CPU in float32: a product of a few rows of our own.

A decode step multiplies a few dozen rows, or a few, by every weight of the model; at
such rows the product's time is mostly reading the weight from memory. torch hands it to
MKL, which packs the weight into blocks at every call, a large part of the product's time
at a few dozen rows and fewer. Up to :data:`PACKED_MAX_ROWS` rows this kernel multiplies
by a copy of the weight packed once (:func:`pack`: ``[ceil(N / 32), K, 32]``, 32 of its
output rows side by side at each input feature), so that a block of 32 outputs is one
sequential stream: at each input feature it loads the block's two vectors (AVX-512) and
multiplies them by each input row's value, up to 12 rows in 24 accumulators; more rows
take the block again from the cache, and the next block is prefetched meanwhile.
:class:`DecodeLinear` makes the copy at its first such product and again once its
weight has changed (a weight update, packed into the same memory): one more copy of the
linear layers' weights. Products of more rows, where the multiply-adds bound the time,
read the weight as loaded, 14 of its rows at a time against all the input rows held
transposed, 16 a vector. On a 2-core Intel Xeon with AMX, SmolLM2-135M's products of
4-12 rows took 1.2-1.3× less time through the packed copy than through the weight as
loaded (bench/README, "A product of our own").

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

The same library holds a decode step's whole decoder layer (:mod:`asyncrl.engines.cpu_decode`)
and the trainer's elementwise passes and packed attention, forward and backward
(:mod:`asyncrl.train.cpu_fused`). Those share their work between torch's threads: the
library is built with OpenMP (``-fopenmp``, linked to the ``libgomp`` torch has already
loaded, so one pool of threads serves both), and without it they run on the calling
thread.
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
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from asyncrl.runtime.log import get_logger

log = get_logger(part="cpu-linear")

MIN_ROWS, MAX_ROWS = 4, 32
"""The rows of the products sent to the kernel. Fewer go to ``F.linear``: MKL's product of
one to three rows (a matrix-vector product, in effect) streams the weight as fast or a
little faster. More go there too: from 33 rows on MKL's packing pays for itself, and a
prefill's product is larger still."""

BLOCK_ROWS = 32
"""The weight rows the kernel multiplies at once: two AVX-512 vectors of 16 floats."""

PACKED_MAX_ROWS = 24
"""Products of up to this many rows read the packed weight; more (25 to 32) read the
weight as loaded, 14 of its rows at a time against all the rows held transposed in two
vectors of 16 (that product takes 17 to 32 rows only, so this is at least 16), which is
as fast or faster there: at so many rows the product is bound by the multiply-adds, not
by reading the weight, and that kernel loads fewer operands per multiply-add."""

SOURCE = r"""
#include <stdint.h>
#include <math.h>
#include <stdlib.h>

/* 1 where the training passes share their work between threads (built with OpenMP) */
int asyncrl_shares_threads(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* MC input rows by one block of 32 weight rows packed [K][32], two vectors of 16: lane j
   of out[i] is bias[j] followed by one chain of fused multiply-adds x[i][k] * w[k][j] over
   k in order. Only the lanes in `lo`/`hi` are stored (a weight's last block may be short).
   Prefetches `pfn` bytes at `pf` (the next block), two lines per k. */
#define BLOCK(MC)                                                                        \
    static void block_##MC(const float *wp, int64_t K, const float *x, int64_t xs,        \
                           __m512 b0, __m512 b1, float *out, int64_t os, __mmask16 lo,    \
                           __mmask16 hi, const char *pf, int64_t pfn) {                   \
        __m512 acc0[MC], acc1[MC];                                                       \
        for (int i = 0; i < MC; i++) {                                                   \
            acc0[i] = b0;                                                                \
            acc1[i] = b1;                                                                \
        }                                                                                \
        for (int64_t k = 0; k < K; k++) {                                                \
            if (k * 128 < pfn) {                                                         \
                _mm_prefetch(pf + k * 128, _MM_HINT_T0);                                 \
                _mm_prefetch(pf + k * 128 + 64, _MM_HINT_T0);                            \
            }                                                                            \
            __m512 w0 = _mm512_loadu_ps(wp + k * 32);                                    \
            __m512 w1 = _mm512_loadu_ps(wp + k * 32 + 16);                               \
            for (int i = 0; i < MC; i++) {                                               \
                __m512 xi = _mm512_set1_ps(x[i * xs + k]);                               \
                acc0[i] = _mm512_fmadd_ps(w0, xi, acc0[i]);                              \
                acc1[i] = _mm512_fmadd_ps(w1, xi, acc1[i]);                              \
            }                                                                            \
        }                                                                                \
        for (int i = 0; i < MC; i++) {                                                   \
            _mm512_mask_storeu_ps(out + i * os, lo, acc0[i]);                            \
            _mm512_mask_storeu_ps(out + i * os + 16, hi, acc1[i]);                       \
        }                                                                                \
    }

BLOCK(1) BLOCK(2) BLOCK(3) BLOCK(4) BLOCK(5) BLOCK(6)
BLOCK(7) BLOCK(8) BLOCK(9) BLOCK(10) BLOCK(11) BLOCK(12)

typedef void (*block_fn)(const float *, int64_t, const float *, int64_t, __m512, __m512,
                         float *, int64_t, __mmask16, __mmask16, const char *, int64_t);
static const block_fn blocks[13] = {0,       block_1, block_2,  block_3,  block_4,
                                    block_5, block_6, block_7,  block_8,  block_9,
                                    block_10, block_11, block_12};

static __mmask16 lanes(int64_t n) { return n >= 16 ? 0xFFFF : n <= 0 ? 0 : (__mmask16)((1u << n) - 1); }

int asyncrl_cpu_linear_lanes(void) { return 16; }

/* w [N, K] (rows ws apart) packed into wp [ceil(N / 32)][K][32], zero rows past N: the
   block's 32 rows read side by side, 16 features at a time, into a tile in L1; the packed
   block written in order, past the caches (nothing reads it before the next product). */
void asyncrl_cpu_pack(const float *w, int64_t N, int64_t K, int64_t ws, float *wp) {
    __m512i col = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(16));
    float tile[32][16] __attribute__((aligned(64)));
    for (int64_t n0 = 0; n0 < N; n0 += 32) {
        float *block = wp + n0 * K;
        int64_t rows = N - n0 < 32 ? N - n0 : 32;
        for (int64_t k0 = 0; k0 < K; k0 += 16) {
            int64_t kn = K - k0 < 16 ? K - k0 : 16;
            __mmask16 m = lanes(kn);
            for (int64_t j = 0; j < 32; j++)
                _mm512_store_ps(tile[j], j < rows ? _mm512_maskz_loadu_ps(m, w + (n0 + j) * ws + k0)
                                                  : _mm512_setzero_ps());
            for (int64_t k = 0; k < kn; k++) {
                float *dst = block + (k0 + k) * 32;
                __m512 lo = _mm512_i32gather_ps(col, &tile[0][k], 4);
                __m512 hi = _mm512_i32gather_ps(col, &tile[16][k], 4);
                if (((uintptr_t)dst & 63) == 0) {
                    _mm512_stream_ps(dst, lo);
                    _mm512_stream_ps(dst + 16, hi);
                } else {
                    _mm512_storeu_ps(dst, lo);
                    _mm512_storeu_ps(dst + 16, hi);
                }
            }
        }
    }
    _mm_sfence();
}

/* out[m, n] = bias[n] + sum_k x[m, k] w[n, k]; x [M, K] rows xs apart, the weight packed
   as [ceil(N / 32)][K][32] (wp[b][k][j] = w[32 b + j, k], zero past N), out [M, N] rows
   os apart, bias [N] or null. 0 when done, < 0 when it cannot. */
int asyncrl_cpu_linear_packed(const float *x, int64_t M, int64_t K, int64_t xs, const float *wp,
                              int64_t N, const float *bias, float *out, int64_t os) {
    if (M < 1 || K < 1 || N < 1) return -1;
    int64_t chunks = (M + 11) / 12; /* at most 12 rows at once: 24 accumulators */
    for (int64_t n0 = 0; n0 < N; n0 += 32) {
        __mmask16 lo = lanes(N - n0), hi = lanes(N - n0 - 16);
        __m512 b0 = bias ? _mm512_maskz_loadu_ps(lo, bias + n0) : _mm512_setzero_ps();
        __m512 b1 = bias ? _mm512_maskz_loadu_ps(hi, bias + n0 + 16) : _mm512_setzero_ps();
        const float *w = wp + n0 * K;
        const char *pf = (const char *)(w + 32 * K);
        int64_t pfn = N - n0 > 32 ? 32 * K * (int64_t)sizeof(float) : 0;
        for (int64_t c = 0, m0 = 0; c < chunks; c++) { /* the block stays in cache */
            int64_t mc = (M - m0 + (chunks - c) - 1) / (chunks - c);
            blocks[mc](w, K, x + m0 * xs, xs, b0, b1, out + m0 * os + n0, os, lo, hi, pf, pfn);
            m0 += mc;
            pfn = 0;
        }
    }
    return 0;
}
/* `n` floats of a buffer kept per thread (*buf, *cap), grown as needed; null when memory
   cannot be had. */
static float *grown(float **buf, size_t *cap, size_t n) {
    if (n > *cap) {
        free(*buf);
        *buf = aligned_alloc(64, (n * sizeof(float) + 63) / 64 * 64);
        *cap = *buf ? n : 0;
    }
    return *buf;
}

/* x^T of the call, [K][mp] with the rows zero-padded to mp (32). */
static __thread float *xt_buf;
static __thread size_t xt_cap;

static float *xt_get(size_t n) { return grown(&xt_buf, &xt_cap, n); }

/* One tile: weight rows n0..n0+MR-1 (of which `rows` exist) by the 16*NV input rows
   of x^T, each output one chain of multiply-adds over k in order. Prefetches
   `pfn` bytes at `pf` (the next tile) a line per k. Scatters the results to out[m, n]. */
#define TILE(MR, NV)                                                                     \
    static void tile_##MR##_##NV(const float *w, int64_t ws, int64_t K, const float *xt,  \
                                 int64_t mp, const float *bias, float *out, int64_t os,  \
                                 int64_t mvalid, int rows, const char *pf,               \
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
            for (int v = 0; v < NV; v++) xv[v] = _mm512_load_ps(xt + k * mp + 16 * v);  \
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
            __mmask16 mask = lanes(left);                                                \
            float *base = out + 16 * v * os;                                             \
            for (int i = 0; i < MR && i < rows; i++)                                     \
                _mm512_mask_i32scatter_ps(base + i, mask, idx, acc[i][v], 4);            \
        }                                                                                \
    }

TILE(14, 2)

/* The same product by the weight as loaded, of 17 to 32 rows (two vectors of them):
   out[m, n] = bias[n] + sum_k x[m, k] w[n, k]; x [M, K] rows xs apart, w [N, K] rows ws
   apart, out [M, N] rows os apart. 0 when done, < 0 when it cannot. */
int asyncrl_cpu_linear_rows(const float *x, int64_t M, int64_t K, int64_t xs, const float *w,
                            int64_t N, int64_t ws, const float *bias, float *out, int64_t os) {
    if (M < 17 || M > 32 || K < 1 || N < 1 || os * 15 > INT32_MAX) return -1;
    int64_t mp = 32;
    float *xt = xt_get((size_t)(K * mp));
    if (!xt) return -2;
    for (int64_t k = 0; k < K; k++) {
        float *row = xt + k * mp;
        for (int64_t m = 0; m < M; m++) row[m] = x[m * xs + k];
        for (int64_t m = M; m < mp; m++) row[m] = 0.0f;
    }
    for (int64_t n0 = 0; n0 < N; n0 += 14) {
        int rows = N - n0 < 14 ? (int)(N - n0) : 14;
        int64_t next = N - (n0 + 14);
        next = next < 0 ? 0 : next > 14 ? 14 : next;
        const char *pf = (const char *)(w + (n0 + 14) * ws);
        int64_t pfn = next * ws * (int64_t)sizeof(float);
        const float *b = bias ? bias + n0 : 0;
        tile_14_2(w + n0 * ws, ws, K, xt, mp, b, out + n0, os, M, rows, pf, pfn);
    }
    return 0;
}
/* ---- a decoder layer of a decode step, whole (the llama / qwen2 kind) ------------------ */

typedef struct {
    const float *packed; /* [ceil(n / 32)][k][32] (asyncrl_cpu_pack) */
    const float *weight; /* [n][k] as loaded */
    const float *bias;   /* [n] or null */
    int64_t n, k;
} asyncrl_linear;

typedef struct {
    asyncrl_linear q, k, v, o, gate, up, down;
    const float *norm1, *norm2; /* the RMSNorms' weights [d] */
    float eps1, eps2;
    float *keys, *values;              /* this layer's [rows][kv heads][columns][head dim] */
    int64_t row_stride, head_stride;   /* in floats; a column is head dim floats */
} asyncrl_layer;

/* out = x w^T + bias, m rows: by the packed weight up to 24 rows, else as loaded */
static int product(const asyncrl_linear *l, const float *x, int64_t m, float *out) {
    if (m <= 24) return asyncrl_cpu_linear_packed(x, m, l->k, l->k, l->packed, l->n, l->bias, out, l->n);
    return asyncrl_cpu_linear_rows(x, m, l->k, l->k, l->weight, l->n, l->k, l->bias, out, l->n);
}

/* transformers' RMSNorm in float32: w * (x * 1 / sqrt(mean(x^2) + eps)) */
static void rms_norm(const float *x, int64_t d, const float *w, float eps, float *out) {
    __m512 acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= d; i += 16) {
        __m512 v = _mm512_loadu_ps(x + i);
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    float ss = _mm512_reduce_add_ps(acc);
    for (; i < d; i++) ss += x[i] * x[i];
    float r = 1.0f / __builtin_sqrtf(ss / (float)d + eps);
    for (i = 0; i < d; i++) out[i] = w[i] * (x[i] * r);
}

/* e^x, 16 lanes: 2^n e^r with n = round(x / ln 2) and e^r by its Taylor polynomial to
   r^7 / 7! (|r| <= ln 2 / 2: relative error under 2e-7); x below -87 gives 0 or a
   denormal, above 88 infinity is not reached here (scores minus their maximum are <= 0,
   a gate's negation is clamped). */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-100.0f));
    x = _mm512_min_ps(x, _mm512_set1_ps(88.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* x * cos + rotate_half(x) * sin over one head of `hd` (rotate_half: the halves swapped,
   the first negated) */
static void rotate(float *x, int64_t hd, const float *cos, const float *sin) {
    float t[512];
    int64_t h = hd / 2;
    for (int64_t i = 0; i < hd; i++) t[i] = i < h ? -x[i + h] : x[i - h];
    for (int64_t i = 0; i < hd; i++) x[i] = x[i] * cos[i] + t[i] * sin[i];
}

/* A decoder layer's work memory. */
static __thread float *work_buf;
static __thread size_t work_cap;

/* One decoder layer for `rows` rows of one token each, in place on the residual stream
   x [rows][d]: RMSNorm, q/k/v products, rotary positions (cos/sin [rows][hd]), the new
   keys and values written at column `cols - 1`, attention of each query head over the
   columns `mask` [rows][cols] allows (its key head's, read once for the heads that share
   it), the output product added to x; RMSNorm, gate and up products, silu(gate) * up, the
   down product added to x. hd a multiple of 16, at most 512; rows 1 to 32; at most 64 query
   heads a key head. 0 when done, < 0 when it cannot (then x and the column written are
   not to be used: the step is to be run again another way). */
int asyncrl_decode_layer(const asyncrl_layer *L, float *x, int64_t rows, int64_t d,
                         int64_t heads, int64_t kv_heads, int64_t hd, const float *cos,
                         const float *sin, const uint8_t *mask, int64_t cols, float scale) {
    if (rows < 1 || rows > 32 || hd % 16 || hd > 512 || kv_heads < 1 || heads % kv_heads ||
        heads / kv_heads > 64 || cols < 1)
        return -1;
    int64_t g = heads / kv_heads, f = L->gate.n, qd = heads * hd, kd = kv_heads * hd;
    int64_t vecs = hd / 16;
    int64_t chunks = (cols + 15) / 16;
    size_t need = (size_t)(rows * (d + qd + 2 * kd + qd + 2 * f + d) + g * cols + g * hd + chunks);
    float *w = grown(&work_buf, &work_cap, need);
    if (!w) return -2;
    float *h = w, *q = h + rows * d, *k = q + rows * qd, *v = k + rows * kd, *a = v + rows * kd;
    float *gate = a + rows * qd, *up = gate + rows * f, *tmp = up + rows * f;
    float *score = tmp + rows * d, *acc = score + g * cols;
    __mmask16 *allowed = (__mmask16 *)(acc + g * hd); /* a row's mask, 16 columns a word */
    int64_t col = cols - 1;
    int code = 0;

    for (int64_t r = 0; r < rows; r++) rms_norm(x + r * d, d, L->norm1, L->eps1, h + r * d);
    code |= product(&L->q, h, rows, q);
    code |= product(&L->k, h, rows, k);
    code |= product(&L->v, h, rows, v);
    if (code) return -3;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t j = 0; j < heads; j++) rotate(q + r * qd + j * hd, hd, cos + r * hd, sin + r * hd);
        for (int64_t j = 0; j < kv_heads; j++) {
            rotate(k + r * kd + j * hd, hd, cos + r * hd, sin + r * hd);
            int64_t at = r * L->row_stride + j * L->head_stride + col * hd;
            for (int64_t i = 0; i < hd; i++) {
                L->keys[at + i] = k[r * kd + j * hd + i];
                L->values[at + i] = v[r * kd + j * hd + i];
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *m = mask + r * cols;
        for (int64_t b = 0; b < chunks; b++) {
            __mmask16 bits = 0;
            for (int64_t t = 0; t < 16 && 16 * b + t < cols; t++)
                if (m[16 * b + t]) bits |= (__mmask16)(1u << t);
            allowed[b] = bits;
        }
        for (int64_t kh = 0; kh < kv_heads; kh++) {
            const float *K = L->keys + r * L->row_stride + kh * L->head_stride;
            const float *V = L->values + r * L->row_stride + kh * L->head_stride;
            const float *qh = q + r * qd + kh * g * hd;
            float top[64];
            for (int64_t j = 0; j < g; j++) top[j] = -__builtin_inff();
            /* scores: each allowed column's key read once for the g query heads */
            for (int64_t c = 0; c < cols; c++) {
                if (!m[c]) continue;
                for (int64_t j = 0; j < g; j++) {
                    __m512 s = _mm512_setzero_ps();
                    for (int64_t u = 0; u < vecs; u++)
                        s = _mm512_fmadd_ps(_mm512_loadu_ps(qh + j * hd + 16 * u),
                                            _mm512_loadu_ps(K + c * hd + 16 * u), s);
                    float sc = _mm512_reduce_add_ps(s) * scale;
                    score[j * cols + c] = sc;
                    if (sc > top[j]) top[j] = sc;
                }
            }
            /* weights e^(s - max), their sums, and the weighted values */
            float total[64];
            for (int64_t j = 0; j < g; j++) {
                total[j] = 0.0f;
                for (int64_t i = 0; i < hd; i++) acc[j * hd + i] = 0.0f;
            }
            for (int64_t j = 0; j < g; j++) {
                float *s = score + j * cols;
                int64_t c = 0;
                __m512 sum = _mm512_setzero_ps();
                __m512 mx = _mm512_set1_ps(top[j]);
                for (; c < cols; c += 16) {
                    __mmask16 ok = allowed[c / 16];
                    __m512 e = _mm512_maskz_mov_ps(
                        ok, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(ok, s + c), mx)));
                    _mm512_mask_storeu_ps(s + c, ok, e);
                    sum = _mm512_add_ps(sum, e);
                }
                total[j] = _mm512_reduce_add_ps(sum);
            }
            for (int64_t c = 0; c < cols; c++) {
                if (!m[c]) continue;
                for (int64_t u = 0; u < vecs; u++) {
                    __m512 val = _mm512_loadu_ps(V + c * hd + 16 * u);
                    for (int64_t j = 0; j < g; j++) {
                        float *o = acc + j * hd + 16 * u;
                        _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_set1_ps(score[j * cols + c]),
                                                            val, _mm512_loadu_ps(o)));
                    }
                }
            }
            for (int64_t j = 0; j < g; j++) {
                float inv = 1.0f / total[j];
                float *out = a + r * qd + (kh * g + j) * hd;
                for (int64_t i = 0; i < hd; i++) out[i] = acc[j * hd + i] * inv;
            }
        }
    }
    if (product(&L->o, a, rows, tmp)) return -3;
    for (int64_t i = 0; i < rows * d; i++) x[i] += tmp[i];
    for (int64_t r = 0; r < rows; r++) rms_norm(x + r * d, d, L->norm2, L->eps2, h + r * d);
    code |= product(&L->gate, h, rows, gate);
    code |= product(&L->up, h, rows, up);
    if (code) return -3;
    /* silu(gate) * up, silu(z) = z / (1 + e^-z) */
    int64_t n = rows * f, i = 0;
    for (; i < n; i += 16) {
        __mmask16 in = lanes(n - i);
        __m512 z = _mm512_maskz_loadu_ps(in, gate + i);
        __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), z));
        __m512 s = _mm512_div_ps(z, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
        _mm512_mask_storeu_ps(gate + i, in, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(in, up + i)));
    }
    if (product(&L->down, gate, rows, tmp)) return -3;
    for (int64_t j = 0; j < rows * d; j++) x[j] += tmp[j];
    return 0;
}
/* ---- work shared between threads ---- */

/* task(ctx, i) for every i < n, on up to `threads` threads of the OpenMP pool torch's own
   operations run on (the library is built against the same libgomp): each thread takes
   the next index when it is done with its last, so a thread that another process's work
   slows (generation beside the trainer on a core) takes fewer and the call ends when the
   work does, not when its slowest thread's fixed share does. A task writes only what is
   its own, so the results do not depend on the threads or the order. Without OpenMP, or
   at one thread, the tasks run in order on the calling thread. */
typedef void (*task_fn)(void *ctx, int64_t i);

static void run_tasks(task_fn task, void *ctx, int64_t n, int threads) {
#ifdef _OPENMP
    if (threads > 1 && n > 1) {
        int64_t next = 0;
        int nt = (int64_t)threads < n ? threads : (int)n;
#pragma omp parallel num_threads(nt)
        {
            int64_t i;
            while ((i = __atomic_fetch_add(&next, 1, __ATOMIC_RELAXED)) < n) task(ctx, i);
        }
        return;
    }
#else
    (void)threads;
#endif
    for (int64_t i = 0; i < n; i++) task(ctx, i);
}

/* ---- training's elementwise parts, forward and backward, whole rows at a time ---- */

/* rows a task of RMSNorm, tokens one of the rotary map, floats one of SwiGLU */
#define ROWS_A_TASK 32
#define FLOATS_A_TASK 8192

static inline int64_t task_end(int64_t i, int64_t step, int64_t n) {
    return (i + 1) * step < n ? (i + 1) * step : n;
}

typedef struct {
    const float *x, *g, *w, *rstd;
    int64_t rows, d, dp;
    float eps;
    float *y, *rstd_out, *dx, *part;
} rms_job;

static void rms_forward_task(void *ctx, int64_t c) {
    const rms_job *jb = ctx;
    int64_t d = jb->d;
    for (int64_t r = c * ROWS_A_TASK; r < task_end(c, ROWS_A_TASK, jb->rows); r++) {
        const float *xr = jb->x + r * d;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < d; i += 16) {
            __m512 v = _mm512_maskz_loadu_ps(lanes(d - i), xr + i);
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        float s = 1.0f / __builtin_sqrtf(_mm512_reduce_add_ps(acc) / (float)d + jb->eps);
        jb->rstd_out[r] = s;
        __m512 sv = _mm512_set1_ps(s);
        for (int64_t i = 0; i < d; i += 16) {
            __mmask16 in = lanes(d - i);
            __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(in, xr + i), sv);
            _mm512_mask_storeu_ps(jb->y + r * d + i, in, _mm512_mul_ps(_mm512_maskz_loadu_ps(in, jb->w + i), v));
        }
    }
}

/* RMSNorm of `rows` rows of d: y = w * (x * r), r = 1 / sqrt(mean(x^2) + eps), kept in
   rstd[row] for the backward */
int asyncrl_rms_forward(const float *x, int64_t rows, int64_t d, const float *w, float eps,
                        float *y, float *rstd, int threads) {
    rms_job jb = {.x = x, .w = w, .rows = rows, .d = d, .eps = eps, .y = y, .rstd_out = rstd};
    run_tasks(rms_forward_task, &jb, (rows + ROWS_A_TASK - 1) / ROWS_A_TASK, threads);
    return 0;
}

/* a task's rows of the backward; its share of dw into its own dp floats of part */
static void rms_backward_task(void *ctx, int64_t c) {
    const rms_job *jb = ctx;
    int64_t d = jb->d;
    float *dw = jb->part + c * jb->dp;
    for (int64_t i = 0; i < d; i++) dw[i] = 0.0f;
    for (int64_t r = c * ROWS_A_TASK; r < task_end(c, ROWS_A_TASK, jb->rows); r++) {
        const float *xr = jb->x + r * d, *gr = jb->g + r * d, *w = jb->w;
        __m512 sv = _mm512_set1_ps(jb->rstd[r]), acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < d; i += 16) {
            __mmask16 in = lanes(d - i);
            __m512 xh = _mm512_mul_ps(_mm512_maskz_loadu_ps(in, xr + i), sv);
            __m512 gv = _mm512_maskz_loadu_ps(in, gr + i);
            acc = _mm512_fmadd_ps(_mm512_mul_ps(gv, _mm512_maskz_loadu_ps(in, w + i)), xh, acc);
            _mm512_mask_storeu_ps(dw + i, in, _mm512_fmadd_ps(gv, xh, _mm512_maskz_loadu_ps(in, dw + i)));
        }
        __m512 mv = _mm512_set1_ps(_mm512_reduce_add_ps(acc) / (float)d);
        for (int64_t i = 0; i < d; i += 16) {
            __mmask16 in = lanes(d - i);
            __m512 xh = _mm512_mul_ps(_mm512_maskz_loadu_ps(in, xr + i), sv);
            __m512 gw = _mm512_mul_ps(_mm512_maskz_loadu_ps(in, gr + i), _mm512_maskz_loadu_ps(in, w + i));
            _mm512_mask_storeu_ps(jb->dx + r * d + i, in, _mm512_mul_ps(sv, _mm512_fnmadd_ps(xh, mv, gw)));
        }
    }
}

static __thread float *part_buf;
static __thread size_t part_cap;

/* its backward from the output's gradient g: with xh = x r and gw = g w,
   dx = r (gw - xh mean(gw xh)); dw (d floats, added to) += sum over rows of g xh, summed
   a task's rows at a time and then over the tasks in order */
int asyncrl_rms_backward(const float *x, const float *g, int64_t rows, int64_t d,
                         const float *w, const float *rstd, float *dx, float *dw, int threads) {
    int64_t tasks = (rows + ROWS_A_TASK - 1) / ROWS_A_TASK, dp = (d + 15) / 16 * 16;
    float *part = grown(&part_buf, &part_cap, (size_t)(tasks * dp + 1));
    if (!part) return -2;
    rms_job jb = {.x = x, .g = g, .w = w, .rstd = rstd, .rows = rows, .d = d, .dp = dp,
                  .dx = dx, .part = part};
    run_tasks(rms_backward_task, &jb, tasks, threads);
    for (int64_t c = 0; c < tasks; c++)
        for (int64_t i = 0; i < d; i++) dw[i] += part[c * dp + i];
    return 0;
}

typedef struct {
    const float *a, *b, *g;
    int64_t n;
    float *out, *db;
} swiglu_job;

static void swiglu_forward_task(void *ctx, int64_t c) {
    const swiglu_job *jb = ctx;
    int64_t n = task_end(c, FLOATS_A_TASK, jb->n);
    for (int64_t i = c * FLOATS_A_TASK; i < n; i += 16) {
        __mmask16 in = lanes(n - i);
        __m512 z = _mm512_maskz_loadu_ps(in, jb->a + i);
        __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), z));
        __m512 s = _mm512_div_ps(z, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
        _mm512_mask_storeu_ps(jb->out + i, in, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(in, jb->b + i)));
    }
}

/* silu(a) * b over n floats, silu(z) = z / (1 + e^-z) */
int asyncrl_swiglu_forward(const float *a, const float *b, int64_t n, float *out, int threads) {
    swiglu_job jb = {.a = a, .b = b, .n = n, .out = out};
    run_tasks(swiglu_forward_task, &jb, (n + FLOATS_A_TASK - 1) / FLOATS_A_TASK, threads);
    return 0;
}

static void swiglu_backward_task(void *ctx, int64_t c) {
    const swiglu_job *jb = ctx;
    const __m512 one = _mm512_set1_ps(1.0f);
    int64_t n = task_end(c, FLOATS_A_TASK, jb->n);
    for (int64_t i = c * FLOATS_A_TASK; i < n; i += 16) {
        __mmask16 in = lanes(n - i);
        __m512 z = _mm512_maskz_loadu_ps(in, jb->a + i);
        __m512 s = _mm512_div_ps(one, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), z))));
        __m512 gv = _mm512_maskz_loadu_ps(in, jb->g + i);
        __m512 gs = _mm512_mul_ps(gv, s);
        _mm512_mask_storeu_ps(jb->db + i, in, _mm512_mul_ps(gs, z));
        __m512 t = _mm512_fmadd_ps(z, _mm512_sub_ps(one, s), one);
        _mm512_mask_storeu_ps(jb->out + i, in, _mm512_mul_ps(_mm512_mul_ps(gs, _mm512_maskz_loadu_ps(in, jb->b + i)), t));
    }
}

/* its backward from the output's gradient g: with s = sigmoid(a),
   da = g b s (1 + a (1 - s)), db = g a s */
int asyncrl_swiglu_backward(const float *a, const float *b, const float *g, int64_t n, float *da,
                            float *db, int threads) {
    swiglu_job jb = {.a = a, .b = b, .g = g, .n = n, .out = da, .db = db};
    run_tasks(swiglu_backward_task, &jb, (n + FLOATS_A_TASK - 1) / FLOATS_A_TASK, threads);
    return 0;
}

typedef struct {
    const float *x, *cos, *sin;
    int64_t tokens, heads, hd, st, sh;
    float *out;
    int back;
} rope_job;

static void rope_task(void *ctx, int64_t c) {
    const rope_job *jb = ctx;
    int64_t h = jb->hd / 2, hd = jb->hd, heads = jb->heads;
    for (int64_t t = c * ROWS_A_TASK; t < task_end(c, ROWS_A_TASK, jb->tokens); t++) {
        const float *cs = jb->cos + t * hd, *sn = jb->sin + t * hd;
        for (int64_t k = 0; k < heads; k++) {
            const float *xv = jb->x + t * jb->st + k * jb->sh;
            float *o = jb->out + (t * heads + k) * hd;
            for (int64_t i = 0; i < h; i += 16) {
                __mmask16 in = lanes(h - i);
                __m512 lo = _mm512_maskz_loadu_ps(in, xv + i), hi = _mm512_maskz_loadu_ps(in, xv + h + i);
                __m512 clo = _mm512_maskz_loadu_ps(in, cs + i), chi = _mm512_maskz_loadu_ps(in, cs + h + i);
                __m512 slo = _mm512_maskz_loadu_ps(in, sn + i), shi = _mm512_maskz_loadu_ps(in, sn + h + i);
                __m512 a, b;
                if (!jb->back) {
                    /* out_lo = lo c_lo - hi s_lo; out_hi = hi c_hi + lo s_hi */
                    a = _mm512_sub_ps(_mm512_mul_ps(lo, clo), _mm512_mul_ps(hi, slo));
                    b = _mm512_add_ps(_mm512_mul_ps(hi, chi), _mm512_mul_ps(lo, shi));
                } else {
                    /* dx_lo = g_lo c_lo + g_hi s_hi; dx_hi = g_hi c_hi - g_lo s_lo */
                    a = _mm512_add_ps(_mm512_mul_ps(lo, clo), _mm512_mul_ps(hi, shi));
                    b = _mm512_sub_ps(_mm512_mul_ps(hi, chi), _mm512_mul_ps(lo, slo));
                }
                _mm512_mask_storeu_ps(o + i, in, a);
                _mm512_mask_storeu_ps(o + h + i, in, b);
            }
        }
    }
}

/* rotary positions on x [tokens, heads, hd] (element (t, h, i) at x[t * st + h * sh + i]),
   cos and sin [tokens, hd], into out [tokens, heads, hd] packed. forward (back = 0):
   out = x cos + rotate_half(x) sin; back = 1 gives the backward, the gradient of x from
   out's: rotate_half's transpose, dx = g cos - rotate_half(g sin) */
int asyncrl_rope(const float *x, int64_t tokens, int64_t heads, int64_t hd, int64_t st, int64_t sh,
                 const float *cos, const float *sin, float *out, int back, int threads) {
    if (hd % 2 != 0) return -1;
    rope_job jb = {.x = x, .cos = cos, .sin = sin, .tokens = tokens, .heads = heads, .hd = hd,
                   .st = st, .sh = sh, .out = out, .back = back};
    run_tasks(rope_task, &jb, (tokens + ROWS_A_TASK - 1) / ROWS_A_TASK, threads);
    return 0;
}
/* ---- causal attention over the segments of a packed row, forward and backward ---- */

/* Each segment's queries attend to its own keys, bottom-right causal (query i of nq sees
   keys 0 .. i + nk - nq). Query (t, h) is at q[t * sq + h * D], key and value (t, g) at
   k[t * sk + g * D] and v[t * sv + g * D]; key j of segment s is row kidx[cu_k[s] + j] of
   k and v (kidx null: row cu_q[s] + j, with cu_k the same as cu_q). Query head h reads
   key head h / (H / G). */

static __thread float *attn_buf;
static __thread size_t attn_cap;

static inline int64_t round32(int64_t n) { return (n + 31) / 32 * 32; }

/* s[r * kp + j] = sum_d x[r][d] kt[d * ldt + col(j)] for the R rows x[0..R-1] (D floats
   each) and the keys j < n of a segment, whose columns of kt (one key head's keys
   transposed, ldt floats a row, 32 zero columns past the last token) are the runs
   (col, length) of `runs` in order; whole blocks of 16 keys, so s is written up to 15 past
   n (kp >= n + 32) */
#define SCORES(R)                                                                          \
    static void scores_##R(const float *const *x, const float *kt, int64_t ldt, int64_t D, \
                           const int64_t *runs, int64_t n, int64_t kp, float *s) {         \
        for (int64_t j0 = 0; j0 < n; j0 += runs[1], runs += 2) {                           \
            int64_t col = runs[0], len = runs[1] < n - j0 ? runs[1] : n - j0, j = 0;        \
            for (; j + 16 < len; j += 32) {                                                \
                __m512 a[R][2];                                                            \
                for (int r = 0; r < R; r++) a[r][0] = a[r][1] = _mm512_setzero_ps();       \
                const float *tc = kt + col + j;                                            \
                for (int64_t d = 0; d < D; d++) {                                          \
                    __m512 t0 = _mm512_loadu_ps(tc + d * ldt);                             \
                    __m512 t1 = _mm512_loadu_ps(tc + d * ldt + 16);                        \
                    for (int r = 0; r < R; r++) {                                          \
                        __m512 b = _mm512_set1_ps(x[r][d]);                                \
                        a[r][0] = _mm512_fmadd_ps(b, t0, a[r][0]);                         \
                        a[r][1] = _mm512_fmadd_ps(b, t1, a[r][1]);                         \
                    }                                                                      \
                }                                                                          \
                for (int r = 0; r < R; r++) {                                              \
                    _mm512_storeu_ps(s + r * kp + j0 + j, a[r][0]);                        \
                    _mm512_storeu_ps(s + r * kp + j0 + j + 16, a[r][1]);                   \
                }                                                                          \
            }                                                                              \
            if (j < len) {                                                                 \
                __m512 a[R];                                                               \
                for (int r = 0; r < R; r++) a[r] = _mm512_setzero_ps();                    \
                const float *tc = kt + col + j;                                            \
                for (int64_t d = 0; d < D; d++) {                                          \
                    __m512 t0 = _mm512_loadu_ps(tc + d * ldt);                             \
                    for (int r = 0; r < R; r++)                                            \
                        a[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r][d]), t0, a[r]);         \
                }                                                                          \
                for (int r = 0; r < R; r++) _mm512_storeu_ps(s + r * kp + j0 + j, a[r]);   \
            }                                                                              \
        }                                                                                  \
    }
SCORES(1)
SCORES(2)
SCORES(3)
SCORES(4)
SCORES(5)
SCORES(6)
SCORES(7)
SCORES(8)
SCORES(9)
SCORES(10)
SCORES(11)
SCORES(12)
typedef void (*scores_fn)(const float *const *, const float *, int64_t, int64_t, const int64_t *,
                          int64_t, int64_t, float *);
/* up to 12 rows at once: 24 accumulators, each loaded vector of keys used 12 times */
#define SCORE_ROWS 12
static const scores_fn scores_r[SCORE_ROWS + 1] = {
    0, scores_1, scores_2, scores_3, scores_4, scores_5, scores_6,
    scores_7, scores_8, scores_9, scores_10, scores_11, scores_12};

/* scores of `rows` rows (any number), SCORE_ROWS at a time */
static void scores(const float *const *x, int64_t rows, const float *kt, int64_t ldt, int64_t D,
                   const int64_t *runs, int64_t n, int64_t kp, float *s) {
    for (int64_t r0 = 0; r0 < rows; r0 += SCORE_ROWS) {
        int64_t c = rows - r0 < SCORE_ROWS ? rows - r0 : SCORE_ROWS;
        scores_r[c](x + r0, kt, ldt, D, runs, n, kp, s + r0 * kp);
    }
}

/* y[r][c..c+63] = mul * sum_{j < n} w[r * kp + j] row(j)[c..] for the R rows (row(j): the
   key or value row of key j, rs floats apart; y rows ys floats apart) */
#define WEIGH(R)                                                                           \
    static void weigh_##R(const float *w, int64_t kp, const float *base, const int64_t *pos, \
                          int64_t first, int64_t rs, int64_t n, int64_t D, float mul,      \
                          float *y, int64_t ys) {                                          \
        for (int64_t c = 0; c < D; c += 64) {                                              \
            __mmask16 m[4];                                                                \
            for (int u = 0; u < 4; u++) m[u] = lanes(D - c - 16 * u);                      \
            __m512 a[R][4];                                                                \
            for (int r = 0; r < R; r++)                                                    \
                for (int u = 0; u < 4; u++) a[r][u] = _mm512_setzero_ps();                 \
            for (int64_t j = 0; j < n; j++) {                                              \
                const float *row = base + (pos ? pos[j] : first + j) * rs + c;             \
                __m512 vv[4];                                                              \
                for (int u = 0; u < 4; u++) vv[u] = _mm512_maskz_loadu_ps(m[u], row + 16 * u); \
                for (int r = 0; r < R; r++) {                                              \
                    __m512 b = _mm512_set1_ps(w[r * kp + j]);                              \
                    for (int u = 0; u < 4; u++) a[r][u] = _mm512_fmadd_ps(b, vv[u], a[r][u]); \
                }                                                                          \
            }                                                                              \
            __m512 sc = _mm512_set1_ps(mul);                                               \
            for (int r = 0; r < R; r++)                                                    \
                for (int u = 0; u < 4; u++)                                                \
                    _mm512_mask_storeu_ps(y + r * ys + c + 16 * u, m[u],                   \
                                          _mm512_mul_ps(a[r][u], sc));                     \
        }                                                                                  \
    }
WEIGH(1)
WEIGH(2)
WEIGH(3)
WEIGH(4)
typedef void (*weigh_fn)(const float *, int64_t, const float *, const int64_t *, int64_t, int64_t,
                         int64_t, int64_t, float, float *, int64_t);
static const weigh_fn weigh_r[5] = {0, weigh_1, weigh_2, weigh_3, weigh_4};

/* acc[j][..D] (rows dp floats apart) += mul * sum_r w[r * kp + j] x[r][..D], for j < n: a
   key's gradient from R rows' (one vector of the head dim at a time: R of them held) */
#define GATHER(R)                                                                          \
    static void gather_##R(const float *w, int64_t kp, const float *const *x, float mul,   \
                           int64_t n, int64_t D, float *acc, int64_t dp) {                 \
        __m512 sv = _mm512_set1_ps(mul);                                                   \
        for (int64_t c = 0; c < D; c += 16) {                                              \
            __mmask16 m = lanes(D - c);                                                    \
            __m512 xv[R];                                                                  \
            for (int r = 0; r < R; r++)                                                    \
                xv[r] = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x[r] + c), sv);             \
            for (int64_t j = 0; j < n; j++) {                                              \
                float *at = acc + j * dp + c;                                              \
                __m512 a = _mm512_load_ps(at);                                             \
                for (int r = 0; r < R; r++)                                                \
                    a = _mm512_fmadd_ps(_mm512_set1_ps(w[r * kp + j]), xv[r], a);          \
                _mm512_store_ps(at, a);                                                    \
            }                                                                              \
        }                                                                                  \
    }
GATHER(1)
GATHER(2)
GATHER(3)
GATHER(4)
GATHER(5)
GATHER(6)
GATHER(7)
GATHER(8)
GATHER(9)
GATHER(10)
GATHER(11)
GATHER(12)
typedef void (*gather_fn)(const float *, int64_t, const float *const *, float, int64_t, int64_t,
                          float *, int64_t);
static const gather_fn gather_r[SCORE_ROWS + 1] = {
    0, gather_1, gather_2, gather_3, gather_4, gather_5, gather_6,
    gather_7, gather_8, gather_9, gather_10, gather_11, gather_12};

/* gather of `rows` rows (any number), SCORE_ROWS at a time */
static void gather(const float *w, int64_t kp, const float *const *x, int64_t rows, float mul,
                   int64_t n, int64_t D, float *acc, int64_t dp) {
    for (int64_t r0 = 0; r0 < rows; r0 += SCORE_ROWS) {
        int64_t c = rows - r0 < SCORE_ROWS ? rows - r0 : SCORE_ROWS;
        gather_r[c](w + r0 * kp, kp, x + r0, mul, n, D, acc, dp);
    }
}

/* a segment's keys as runs of consecutive rows: (first row, length) pairs into runs
   (2 nk at most), ended by a (0, 0) */
static void key_runs(const int64_t *pos, int64_t first, int64_t nk, int64_t *runs) {
    if (!pos) {
        runs[0] = first, runs[1] = nk, runs[2] = runs[3] = 0;
        return;
    }
    int64_t m = 0;
    for (int64_t j = 0; j < nk; j++) {
        if (m && pos[j] == runs[m - 2] + runs[m - 1]) {
            runs[m - 1]++;
        } else {
            runs[m] = pos[j], runs[m + 1] = 1, m += 2;
        }
    }
    runs[m] = runs[m + 1] = 0;
}

/* segment s of a call: its first query row, its query and key counts, the keys its first
   query does not see past its last (off = nk - nq), its score rows' stride (kp), its keys'
   rows (null: q0 + j) and their runs (written to runs) */
typedef struct {
    int64_t q0, nq, nk, off, kp;
    const int64_t *pos;
} attn_segment;

static attn_segment segment_at(int64_t s, const int64_t *cu_q, const int64_t *cu_k,
                               const int64_t *kidx, int64_t *runs) {
    int64_t nq = cu_q[s + 1] - cu_q[s], nk = cu_k[s + 1] - cu_k[s];
    attn_segment sg = {cu_q[s], nq, nk, nk - nq, round32(nk) + 32, kidx ? kidx + cu_k[s] : 0};
    if (nq) key_runs(sg.pos, sg.q0, nk, runs);
    return sg;
}

/* query heads a key head at most (a block's rows of all of them are scored together) */
#define ATTN_MAX_REP 64

/* the call's layout checked: the query segments cover the row's T tokens in order, each
   segment's nk >= nq keys (the same segments without kidx), every key a row of the T, at
   most ATTN_MAX_REP query heads a key head; the largest nk into *maxk */
static int attn_check(int64_t T, int64_t nseg, const int64_t *cu_q, const int64_t *cu_k,
                      const int64_t *kidx, int64_t H, int64_t G, int64_t D, int64_t *maxk) {
    if (D < 1 || G < 1 || H < G || H % G || H / G > ATTN_MAX_REP || nseg < 0) return -1;
    if (cu_q[0] != 0 || cu_k[0] != 0 || cu_q[nseg] != T) return -1;
    *maxk = 0;
    for (int64_t s = 0; s < nseg; s++) {
        int64_t nq = cu_q[s + 1] - cu_q[s], nk = cu_k[s + 1] - cu_k[s];
        if (nq < 0 || nq > nk || (!kidx && nk != nq)) return -1;
        if (nk > *maxk) *maxk = nk;
    }
    if (kidx) {
        for (int64_t j = 0; j < cu_k[nseg]; j++)
            if (kidx[j] < 0 || kidx[j] >= T) return -1;
    }
    return 0;
}

/* a call's arguments, shared by its tasks */
typedef struct {
    const float *q, *k, *kt, *vt, *v, *out, *dout, *lse_in;
    int64_t sq, sk, sv, ldt, H, G, D, maxk;
    const int64_t *cu_q, *cu_k, *kidx, *units;
    float scale;
    float *o, *lse, *dq, *dk, *dv;
    int err;
} attn_job;

/* forward task s * G + g: segment s's rows of the heads reading key head g */
static void attn_forward_task(void *ctx, int64_t task) {
    attn_job *jb = ctx;
    int64_t G = jb->G, H = jb->H, D = jb->D, rep = H / G, s = task / G, g = task % G;
    int64_t kpm = round32(jb->maxk) + 32;
    float *sc = grown(&attn_buf, &attn_cap, (size_t)(4 * rep * kpm + 4 * jb->maxk + 8));
    if (!sc) {
        __atomic_store_n(&jb->err, 1, __ATOMIC_RELAXED);
        return;
    }
    int64_t *runs = (int64_t *)(sc + 4 * rep * kpm);
    const float *x[4 * ATTN_MAX_REP];
    __m512 sv16 = _mm512_set1_ps(jb->scale);
    attn_segment sg = segment_at(s, jb->cu_q, jb->cu_k, jb->kidx, runs);
    if (sg.nq == 0) return;
    for (int64_t i0 = 0; i0 < sg.nq; i0 += 4) {
        /* the block's 4 (or fewer) query rows of every head reading key head g */
        int nr = sg.nq - i0 < 4 ? (int)(sg.nq - i0) : 4;
        int64_t rows = rep * nr;
        for (int64_t e = 0; e < rows; e++)
            x[e] = jb->q + (sg.q0 + i0 + e % nr) * jb->sq + (g * rep + e / nr) * D;
        int64_t n = i0 + nr + sg.off; /* the keys the block's last row sees */
        scores(x, rows, jb->kt + g * D * jb->ldt, jb->ldt, D, runs, n, sg.kp, sc);
        for (int64_t e = 0; e < rows; e++) {
            float *p = sc + e * sg.kp;
            int64_t vis = i0 + e % nr + sg.off + 1;
            __m512 mx = _mm512_set1_ps(-INFINITY);
            for (int64_t j = 0; j < vis; j += 16) {
                __m512 z = _mm512_mul_ps(_mm512_loadu_ps(p + j), sv16);
                _mm512_storeu_ps(p + j, z);
                mx = _mm512_mask_max_ps(mx, lanes(vis - j), mx, z);
            }
            float top = _mm512_reduce_max_ps(mx);
            __m512 tv = _mm512_set1_ps(top), sum = _mm512_setzero_ps();
            for (int64_t j = 0; j < n; j += 16) {
                __m512 ev = _mm512_maskz_mov_ps(
                    lanes(vis - j), exp16(_mm512_sub_ps(_mm512_loadu_ps(p + j), tv)));
                _mm512_storeu_ps(p + j, ev);
                sum = _mm512_add_ps(sum, ev);
            }
            float total = _mm512_reduce_add_ps(sum);
            jb->lse[(sg.q0 + i0 + e % nr) * H + g * rep + e / nr] = top + logf(total);
            __m512 inv = _mm512_set1_ps(1.0f / total);
            for (int64_t j = 0; j < n; j += 16)
                _mm512_storeu_ps(p + j, _mm512_mul_ps(_mm512_loadu_ps(p + j), inv));
        }
        for (int64_t hh = 0; hh < rep; hh++)
            weigh_r[nr](sc + hh * nr * sg.kp, sg.kp, jb->v + g * D, sg.pos, sg.q0, jb->sv, n, D, 1.0f,
                        jb->o + ((sg.q0 + i0) * H + g * rep + hh) * D, H * D);
    }
}

/* out [T][H][D] packed, lse [T][H]: each row's log of its softmax's sum, in scaled units.
   kt: the keys transposed, [G][D][ldt] (key (t, g) element d at kt[(g * D + d) * ldt + t]),
   zero from column T to ldt >= T + 32. A task is one segment's rows of one key head's
   query heads. */
int asyncrl_attn_forward(const float *q, int64_t sq, const float *kt, int64_t ldt,
                         const float *v, int64_t sv, int64_t H, int64_t G, int64_t D,
                         int64_t T, int64_t nseg, const int64_t *cu_q, const int64_t *cu_k,
                         const int64_t *kidx, float scale, float *out, float *lse, int threads) {
    int64_t maxk;
    if (attn_check(T, nseg, cu_q, cu_k, kidx, H, G, D, &maxk)) return -1;
    attn_job jb = {.q = q, .kt = kt, .v = v, .sq = sq, .sv = sv, .ldt = ldt, .H = H, .G = G,
                   .D = D, .maxk = maxk, .cu_q = cu_q, .cu_k = cu_k, .kidx = kidx,
                   .scale = scale, .o = out, .lse = lse};
    run_tasks(attn_forward_task, &jb, nseg * G, threads);
    return jb.err ? -2 : 0;
}

/* sum_e a[e] b[e] over D floats */
static float dot(const float *a, const float *b, int64_t D) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t e = 0; e < D; e += 16) {
        __mmask16 in = lanes(D - e);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(in, a + e), _mm512_maskz_loadu_ps(in, b + e), acc);
    }
    return _mm512_reduce_add_ps(acc);
}

static __thread float *unit_buf;
static __thread size_t unit_cap;

/* the segments as units for the backward's tasks: runs of consecutive segments whose keys
   no segment outside the run reads (a group's prompt and its completions; a segment alone
   where each reads only its own), so that tasks add to disjoint rows of dk and dv and each
   row's sum is taken in segment order whatever the threads; starts[0..u] bounds them and u
   is returned. Where a segment reads keys of an earlier run (a layout of another kind)
   the whole call is one unit. owner: T scratch. */
static int64_t key_units(int64_t T, int64_t nseg, const int64_t *cu_q, const int64_t *cu_k,
                         const int64_t *kidx, int64_t *owner, int64_t *starts) {
    int64_t u = 0;
    for (int64_t t = 0; t < T; t++) owner[t] = -1;
    for (int64_t s = 0; s < nseg; s++) {
        int64_t nk = cu_k[s + 1] - cu_k[s], first = cu_q[s];
        const int64_t *pos = kidx ? kidx + cu_k[s] : 0;
        int joins = 0;
        for (int64_t j = 0; j < nk; j++) {
            int64_t o = owner[pos ? pos[j] : first + j];
            if (o >= 0 && o == u - 1) {
                joins = 1;
            } else if (o >= 0) {
                starts[0] = 0, starts[1] = nseg;
                return 1;
            }
        }
        if (!joins) starts[u++] = s;
        for (int64_t j = 0; j < nk; j++) owner[pos ? pos[j] : first + j] = u - 1;
    }
    starts[u] = nseg;
    return u;
}

/* backward task u * G + g: the segments of unit u, key head g */
static void attn_backward_task(void *ctx, int64_t task) {
    attn_job *jb = ctx;
    int64_t G = jb->G, H = jb->H, D = jb->D, rep = H / G, g = task % G, unit = task / G;
    int64_t maxk = jb->maxk, kpm = round32(maxk) + 32, dp = (D + 15) / 16 * 16;
    float *pm = grown(&attn_buf, &attn_cap, (size_t)(8 * rep * kpm + 2 * maxk * dp + 4 * maxk + 8));
    if (!pm) {
        __atomic_store_n(&jb->err, 1, __ATOMIC_RELAXED);
        return;
    }
    float *ds = pm + 4 * rep * kpm, *dka = ds + 4 * rep * kpm, *dva = dka + maxk * dp;
    int64_t *runs = (int64_t *)(dva + maxk * dp);
    const float *x[4 * ATTN_MAX_REP], *go[4 * ATTN_MAX_REP];
    __m512 sv16 = _mm512_set1_ps(jb->scale);
    for (int64_t s = jb->units[unit]; s < jb->units[unit + 1]; s++) {
        attn_segment sg = segment_at(s, jb->cu_q, jb->cu_k, jb->kidx, runs);
        if (sg.nq == 0) continue;
        for (int64_t j = 0; j < sg.nk * dp; j++) dka[j] = dva[j] = 0.0f;
        for (int64_t i0 = 0; i0 < sg.nq; i0 += 4) {
            int nr = sg.nq - i0 < 4 ? (int)(sg.nq - i0) : 4;
            int64_t rows = rep * nr, n = i0 + nr + sg.off;
            for (int64_t e = 0; e < rows; e++) {
                int64_t row = sg.q0 + i0 + e % nr, h = g * rep + e / nr;
                x[e] = jb->q + row * jb->sq + h * D;
                go[e] = jb->dout + (row * H + h) * D;
            }
            scores(x, rows, jb->kt + g * D * jb->ldt, jb->ldt, D, runs, n, sg.kp, pm);
            scores(go, rows, jb->vt + g * D * jb->ldt, jb->ldt, D, runs, n, sg.kp, ds); /* dP = dO V^T */
            for (int64_t e = 0; e < rows; e++) {
                int64_t row = sg.q0 + i0 + e % nr, h = g * rep + e / nr;
                float *p = pm + e * sg.kp, *d = ds + e * sg.kp;
                int64_t vis = i0 + e % nr + sg.off + 1;
                float delta = dot(go[e], jb->out + (row * H + h) * D, D);
                __m512 lv = _mm512_set1_ps(jb->lse_in[row * H + h]), dv16 = _mm512_set1_ps(delta);
                for (int64_t j = 0; j < n; j += 16) {
                    __m512 pv = _mm512_maskz_mov_ps(
                        lanes(vis - j), exp16(_mm512_fmsub_ps(_mm512_loadu_ps(p + j), sv16, lv)));
                    _mm512_storeu_ps(p + j, pv);
                    _mm512_storeu_ps(
                        d + j, _mm512_mul_ps(pv, _mm512_sub_ps(_mm512_loadu_ps(d + j), dv16)));
                }
            }
            /* dQ = scale dS K, a head's rows at a time */
            for (int64_t hh = 0; hh < rep; hh++)
                weigh_r[nr](ds + hh * nr * sg.kp, sg.kp, jb->k + g * D, sg.pos, sg.q0, jb->sk, n, D,
                            jb->scale, jb->dq + ((sg.q0 + i0) * H + g * rep + hh) * D, H * D);
            /* dK[j] += scale sum dS[e][j] q_e; dV[j] += sum P[e][j] dO_e, over every
               row of the heads that read key head g */
            gather(ds, sg.kp, x, rows, jb->scale, n, D, dka, dp);
            gather(pm, sg.kp, go, rows, 1.0f, n, D, dva, dp);
        }
        for (int64_t j = 0; j < sg.nk; j++) {
            int64_t row = sg.pos ? sg.pos[j] : sg.q0 + j;
            float *tk = jb->dk + (row * G + g) * D, *tv = jb->dv + (row * G + g) * D;
            for (int64_t e = 0; e < D; e += 16) {
                __mmask16 in = lanes(D - e);
                _mm512_mask_storeu_ps(tk + e, in, _mm512_add_ps(_mm512_maskz_loadu_ps(in, tk + e),
                                                                _mm512_maskz_loadu_ps(in, dka + j * dp + e)));
                _mm512_mask_storeu_ps(tv + e, in, _mm512_add_ps(_mm512_maskz_loadu_ps(in, tv + e),
                                                                _mm512_maskz_loadu_ps(in, dva + j * dp + e)));
            }
        }
    }
}

/* the backward from dout [T][H][D] packed: dq [T][H][D] packed (stored), dk and dv
   [T][G][D] packed (added to: zero them first); k, v as for the forward's weights, kt and
   vt the keys and the values transposed as the forward's kt. A task is one key head of a
   unit of segments (key_units). */
int asyncrl_attn_backward(const float *q, int64_t sq, const float *k, int64_t sk,
                          const float *kt, const float *vt, int64_t ldt, int64_t H, int64_t G,
                          int64_t D, int64_t T, int64_t nseg, const int64_t *cu_q, const int64_t *cu_k,
                          const int64_t *kidx, float scale, const float *out,
                          const float *dout, const float *lse, float *dq, float *dk,
                          float *dv, int threads) {
    int64_t maxk;
    if (attn_check(T, nseg, cu_q, cu_k, kidx, H, G, D, &maxk)) return -1;
    int64_t *owner = (int64_t *)grown(&unit_buf, &unit_cap, (size_t)(2 * (T + nseg + 2)));
    if (!owner) return -2;
    int64_t *starts = owner + T;
    int64_t units = key_units(T, nseg, cu_q, cu_k, kidx, owner, starts);
    attn_job jb = {.q = q, .k = k, .kt = kt, .vt = vt, .out = out, .dout = dout, .lse_in = lse,
                   .sq = sq, .sk = sk, .ldt = ldt, .H = H, .G = G, .D = D, .maxk = maxk,
                   .cu_q = cu_q, .cu_k = cu_k, .kidx = kidx, .units = starts, .scale = scale,
                   .dq = dq, .dk = dk, .dv = dv};
    run_tasks(attn_backward_task, &jb, units * G, threads);
    return jb.err ? -2 : 0;
}
#else
/* without AVX-512 no other kernel is built: kernel() stops at this 0 before it looks up
   any other entry point */
int asyncrl_cpu_linear_lanes(void) { return 0; }
#endif
"""


class Kernel(NamedTuple):
    """The compiled library's entry points."""

    packed: Callable[..., int]
    """``asyncrl_cpu_linear_packed``: a product by a packed weight."""
    rows: Callable[..., int]
    """``asyncrl_cpu_linear_rows``: a product by the weight as loaded."""
    pack: Callable[..., None]
    """``asyncrl_cpu_pack``: a weight packed."""
    layer: Callable[..., int]
    """``asyncrl_decode_layer``: a decoder layer of a decode step, whole
    (:mod:`asyncrl.engines.cpu_decode`)."""
    rms_forward: Callable[..., int]
    """``asyncrl_rms_forward``: RMSNorm of whole rows, keeping each row's scale
    (:mod:`asyncrl.train.cpu_fused`, as the next four)."""
    rms_backward: Callable[..., int]
    """``asyncrl_rms_backward``: its backward."""
    swiglu_forward: Callable[..., int]
    """``asyncrl_swiglu_forward``: ``silu(gate) * up``."""
    swiglu_backward: Callable[..., int]
    """``asyncrl_swiglu_backward``: its backward."""
    rope: Callable[..., int]
    """``asyncrl_rope``: rotary positions, or their backward."""
    attn_forward: Callable[..., int]
    """``asyncrl_attn_forward``: causal attention over a packed row's segments."""
    attn_backward: Callable[..., int]
    """``asyncrl_attn_backward``: its backward."""
    shares_threads: bool
    """Whether the training passes share their work between torch's threads (the library
    built with OpenMP); each runs on the calling thread otherwise."""


_lock = threading.Lock()
_loaded: list[Kernel | None] = []
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
        command = [compiler, "-O3", "-march=native", "-shared", "-fPIC", "-o", str(built)]
        # with OpenMP the training passes share their work with torch's threads (the
        # same libgomp, loaded with torch); without it they run on the calling thread
        for flags in (["-fopenmp"], []):
            done = subprocess.run(
                [*command, *flags, str(source)], capture_output=True, text=True, timeout=120
            )
            if done.returncode == 0:
                break
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-500:]}")
        os.replace(built, target)  # whole or not at all, for another process reading it
    return target


def kernel() -> Kernel | None:
    """The kernel's entry points, compiled and loaded on the first call; ``None`` where it
    cannot run here (the reason logged once)."""
    with _lock:
        if not _loaded:
            fn: Kernel | None = None
            try:
                lib = ctypes.CDLL(str(_build()))
                if lib.asyncrl_cpu_linear_lanes() == 0:
                    raise RuntimeError("this CPU has no AVX-512")
                packed, rows = lib.asyncrl_cpu_linear_packed, lib.asyncrl_cpu_linear_rows
                packer, layer = lib.asyncrl_cpu_pack, lib.asyncrl_decode_layer
                packed.restype, rows.restype, packer.restype = ctypes.c_int, ctypes.c_int, None
                layer.restype = ctypes.c_int
                i64, ptr = ctypes.c_int64, ctypes.c_void_p
                packed.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, ptr, i64]
                rows.argtypes = [ptr, i64, i64, i64, ptr, i64, i64, ptr, ptr, i64]
                packer.argtypes = [ptr, i64, i64, i64, ptr]
                layer.argtypes = [
                    ptr,
                    ptr,
                    i64,
                    i64,
                    i64,
                    i64,
                    i64,
                    ptr,
                    ptr,
                    ptr,
                    i64,
                    ctypes.c_float,
                ]
                f32, c_int = ctypes.c_float, ctypes.c_int
                trains = {
                    # each takes the threads to share its work as its last argument
                    "rms_forward": [ptr, i64, i64, ptr, f32, ptr, ptr, c_int],
                    "rms_backward": [ptr, ptr, i64, i64, ptr, ptr, ptr, ptr, c_int],
                    "swiglu_forward": [ptr, ptr, i64, ptr, c_int],
                    "swiglu_backward": [ptr, ptr, ptr, i64, ptr, ptr, c_int],
                    "rope": [ptr, i64, i64, i64, i64, i64, ptr, ptr, ptr, c_int, c_int],
                    # q, its row stride, keys transposed or values and their strides, heads,
                    # key heads, head dim, tokens, segments; cu_q, cu_k, key index, scale,
                    # then the outputs (and for the backward the saved tensors)
                    "attn_forward": [ptr, i64, ptr, i64, ptr, i64, *[i64] * 5, *[ptr] * 3, f32]
                    + [ptr] * 2
                    + [c_int],
                    "attn_backward": [ptr, i64, ptr, i64, ptr, ptr, *[i64] * 6, *[ptr] * 3, f32]
                    + [ptr] * 6
                    + [c_int],
                }
                for name, argtypes in trains.items():
                    entry = getattr(lib, f"asyncrl_{name}")
                    entry.restype, entry.argtypes = ctypes.c_int, argtypes
                fn = Kernel(
                    packed,
                    rows,
                    packer,
                    layer,
                    **{n: getattr(lib, f"asyncrl_{n}") for n in trains},
                    shares_threads=bool(lib.asyncrl_shares_threads()),
                )
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                log.warning(
                    "the CPU kernel library is not available: the hf engine's decode uses "
                    "torch's products (column-major weights), the trainer transformers' own "
                    "layers",
                    reason=f"{type(exc).__name__}: {exc}"[:600],
                )
            _loaded.append(fn)
        return _loaded[0]


def pack(weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``weight`` ``[N, K]`` (float32, on the CPU) as the kernel reads it: ``[ceil(N / 32),
    K, 32]``, 32 of its rows side by side at each input feature, zero rows past ``N``;
    written into ``out`` where it has that shape (no new memory to fault in). Needs the
    kernel (:func:`kernel`)."""
    fn = kernel()
    if fn is None:
        raise RuntimeError("the CPU decode kernel cannot run here")
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
        raise ValueError(
            f"packs a 2-D float32 weight on the CPU, not {weight.dtype} {weight.shape}"
        )
    n, k = weight.shape
    rows = weight.detach().contiguous()
    shape = (-(-n // BLOCK_ROWS), k, BLOCK_ROWS)
    if out is None or tuple(out.shape) != shape or not out.is_contiguous():
        out = torch.empty(shape, dtype=torch.float32)
    fn.pack(rows.data_ptr(), n, k, k, out.data_ptr())
    return out


def _rows_taken(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> int:
    """The rows of ``x`` where the kernel takes this call (see the module's docstring), else 0."""
    k = weight.shape[-1]
    rows = x.numel() // k if k else 0
    if (
        not _loaded
        or _loaded[0] is None
        or not MIN_ROWS <= rows <= MAX_ROWS
        or x.dtype != torch.float32
        or weight.dtype != torch.float32
        or x.device.type != "cpu"
        or not weight.is_contiguous()
        or (bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()))
        or torch.is_grad_enabled()
        or torch.get_num_threads() != 1
    ):
        return 0
    return rows


def product(
    x: torch.Tensor,
    rows: int,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    packed: Callable[[], torch.Tensor],
) -> torch.Tensor:
    """The kernel's product of ``rows`` rows (1 to :data:`MAX_ROWS`; :func:`linear` and
    :class:`DecodeLinear` send it :data:`MIN_ROWS` and more): by the packed weight
    (``packed()``) up to :data:`PACKED_MAX_ROWS` rows, by the weight as loaded above."""
    fn = _loaded[0]
    assert fn is not None
    n, k = weight.shape
    x2 = x.reshape(rows, k).contiguous()
    out = torch.empty(rows, n, dtype=torch.float32)
    b = None if bias is None else bias.data_ptr()
    if rows <= PACKED_MAX_ROWS:
        wp = packed()  # held until the call returns
        code = fn.packed(x2.data_ptr(), rows, k, k, wp.data_ptr(), n, b, out.data_ptr(), n)
    else:
        code = fn.rows(x2.data_ptr(), rows, k, k, weight.data_ptr(), n, k, b, out.data_ptr(), n)
    if code != 0:
        return F.linear(x, weight, bias)
    return out.view(*x.shape[:-1], n)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` by the kernel where it takes the call (see the module's
    docstring), else by torch. Packs ``weight`` for this call alone where the product needs
    it: a layer that multiplies by the same weight again keeps its packed copy
    (:class:`DecodeLinear`)."""
    rows = _rows_taken(x, weight, bias)
    if not rows:
        return F.linear(x, weight, bias)
    return product(x, rows, weight, bias, lambda: pack(weight))


class DecodeLinear(torch.nn.Linear):
    """A ``torch.nn.Linear`` whose inference products of a few rows go to the kernel
    (:func:`linear`), through a packed copy of its weight made at the first such product
    and made again once the weight has changed (written in place, or replaced, as a weight
    update does); its parameters and state dict are the Linear's."""

    _packed: tuple[torch.UntypedStorage, int, int, torch.Tensor] | None = None
    """The packed copy, with what it was packed from: the weight's storage (held, so that
    no other tensor can take its address), address and version counter. An update packs
    into the same copy."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        rows = _rows_taken(input, self.weight, self.bias)
        if not rows:
            return F.linear(input, self.weight, self.bias)
        return product(input, rows, self.weight, self.bias, self.packed_weight)

    def packed_weight(self) -> torch.Tensor:
        """The weight as the kernel reads it (:func:`pack`), packed again where it changed."""
        w = self.weight
        held = self._packed
        if held is None or held[1:3] != (w.data_ptr(), w._version):
            into = None if held is None else held[3]  # the old copy, written over
            self._packed = None  # the old weight's storage no longer held
            held = (w.untyped_storage(), w.data_ptr(), w._version, pack(w, into))
            self._packed = held
        return held[3]


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
