"""An experiment: the softmax of a block's scores with the position terms added in the same compiled pass.

`scores_softmax(scores, c2p, p2c, keep, scaling)` turns `scores` ([n, rows, keys], q . k from a batched product,
unscaled) into probabilities, in place:

    p[a, b] = softmax_b(scores[a, b] * scaling + c2p[a, b] + p2c[a, b]),  keys with keep[b] == 0 at the dtype's minimum

c2p and p2c are the strided views of T and U that `_attend_by_distance` reads (c2p contiguous along keys, p2c
along rows); the pass reads p2c eight keys by eight rows and transposes in registers (AVX2), so that no bias is
written. Returns the log-sum-exp of each row, for the far parts' merge. float32 on the CPU only.

The C source is compiled with the system's gcc on first use (a few seconds) into the user's cache, and runs on
PyTorch's OpenMP threads (libgomp, which PyTorch has already loaded). None where no compiler is found.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import Tensor

SOURCE = r"""
#include <stdint.h>
#include <float.h>
#include <math.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

__attribute__((__simd__("notinbranch"))) float expf(float);  /* libmvec's vector expf */

#ifdef __AVX2__
static inline void transpose8(__m256* r) {
  __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(u0, u4, 0x20); r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  r[2] = _mm256_permute2f128_ps(u2, u6, 0x20); r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  r[4] = _mm256_permute2f128_ps(u0, u4, 0x31); r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  r[6] = _mm256_permute2f128_ps(u2, u6, 0x31); r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}
#endif

/* rows [a0, a1): s = s * scale + c2p (C[a * c_row + b]) + p2c (P[a + b * p_key]); C or P may be NULL */
static void add_terms(float* S, int64_t s_row, const float* C, int64_t c_row, const float* P, int64_t p_key,
                      int a0, int a1, int keys, float scale) {
  int a = a0;
#ifdef __AVX2__
  if (C && P && a1 - a0 >= 8) {
    __m256 vs = _mm256_set1_ps(scale);
    int tiles = (a1 - a0) / 8 * 8, b = 0;
    for (; b + 8 <= keys; b += 8)
      for (a = a0; a < a0 + tiles; a += 8) {
        __m256 r[8];
        for (int k = 0; k < 8; k++) r[k] = _mm256_loadu_ps(P + a + (int64_t)(b + k) * p_key);
        transpose8(r);  /* r[k]: p2c of row a + k, keys b .. b + 7 */
        for (int k = 0; k < 8; k++) {
          float* s = S + (int64_t)(a + k) * s_row + b;
          __m256 x = _mm256_fmadd_ps(_mm256_loadu_ps(s), vs, _mm256_loadu_ps(C + (int64_t)(a + k) * c_row + b));
          _mm256_storeu_ps(s, _mm256_add_ps(x, r[k]));
        }
      }
    for (; b < keys; b++)
      for (a = a0; a < a0 + tiles; a++) {
        float* s = S + (int64_t)a * s_row + b;
        *s = *s * scale + C[(int64_t)a * c_row + b] + P[a + (int64_t)b * p_key];
      }
    a = a0 + tiles;
  }
#endif
  for (; a < a1; a++) {
    float* s = S + (int64_t)a * s_row;
    for (int b = 0; b < keys; b++) {
      float x = s[b] * scale;
      if (C) x += C[(int64_t)a * c_row + b];
      if (P) x += P[a + (int64_t)b * p_key];
      s[b] = x;
    }
  }
}

static void softmax_rows(float* S, int64_t s_row, const uint8_t* keep, float* lse, int rows, int keys) {
  for (int a = 0; a < rows; a++) {
    float* s = S + (int64_t)a * s_row;
    if (keep) for (int b = 0; b < keys; b++) s[b] = keep[b] ? s[b] : -FLT_MAX;
    float m = -INFINITY;
    _Pragma("omp simd reduction(max:m)")
    for (int b = 0; b < keys; b++) m = s[b] > m ? s[b] : m;
    float sum = 0.f;
    for (int b = 0; b < keys; b++) { float e = expf(s[b] - m); s[b] = e; sum += e; }
    float inv = 1.f / sum;
    for (int b = 0; b < keys; b++) s[b] *= inv;
    if (lse) lse[a] = m + logf(sum);
  }
}

void scores_softmax(float* scores, int64_t s_n, int64_t s_row,
                    const float* c2p, int64_t c_g, int64_t c_h, int64_t c_row,
                    const float* p2c, int64_t p_g, int64_t p_h, int64_t p_key,
                    const uint8_t* keep, int64_t keep_g, float* lse,
                    int count, int heads, int rows, int keys, float scale, int threads) {
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (int n = 0; n < count; n++) {
    int g = n / heads, h = n % heads;
    float* S = scores + n * s_n;
    const float* C = c2p ? c2p + g * c_g + h * c_h : 0;
    const float* P = p2c ? p2c + g * p_g + h * p_h : 0;
    for (int a0 = 0; a0 < rows; a0 += 32) {  /* 32 rows at a time: their scores stay in L2 between the passes */
      int a1 = a0 + 32 < rows ? a0 + 32 : rows;
      add_terms(S, s_row, C, c_row, P, p_key, a0, a1, keys, scale);
      softmax_rows(S + (int64_t)a0 * s_row, s_row, keep ? keep + g * keep_g : 0,
                   lse ? lse + (int64_t)n * rows + a0 : 0, a1 - a0, keys);
    }
  }
}
"""

FLAGS = [
    "-O3",
    "-march=native",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fopenmp",
    "-fPIC",
]
_library = None
_failed = False


def _build() -> ctypes.CDLL | None:
    compiler = shutil.which("gcc")
    if compiler is None:
        return None
    digest = hashlib.sha256((SOURCE + " ".join(FLAGS)).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "disentangled" / "kernels"
    target = cache / f"scores_softmax-{digest}.so"
    if not target.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as folder:
            source, objects, built = Path(folder, "k.c"), Path(folder, "k.o"), Path(folder, "k.so")
            source.write_text(SOURCE)
            # compiled and linked apart: linking with the math flags would not add crtfastmath (which sets
            # flush-to-zero for the whole process), but apart leaves no doubt
            subprocess.run([compiler, "-c", *FLAGS, "-o", str(objects), str(source)], check=True, capture_output=True)
            subprocess.run(
                [compiler, "-shared", "-fopenmp", "-o", str(built), str(objects), "-lmvec", "-lm"],
                check=True,
                capture_output=True,
            )
            os.replace(built, target)  # atomic: another process never loads half a file
    library = ctypes.CDLL(str(target))
    pointer, size, integer = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    library.scores_softmax.argtypes = [pointer, size, size, pointer, size, size, size, pointer, size, size, size]
    library.scores_softmax.argtypes += [pointer, size, pointer, integer, integer, integer, integer, ctypes.c_float]
    library.scores_softmax.argtypes += [integer]
    library.scores_softmax.restype = None
    return library


def available() -> bool:
    """Whether the pass is built (building it on first call); False where gcc is missing or fails."""
    global _library, _failed
    if _library is None and not _failed:
        try:
            _library = _build()
        except (OSError, subprocess.CalledProcessError):
            _library = None
        _failed = _library is None
    return _library is not None


def _address(tensor: Tensor | None) -> ctypes.c_void_p | None:
    return ctypes.c_void_p(tensor.data_ptr()) if tensor is not None else None


def scores_softmax(
    scores: Tensor, c2p: Tensor | None, p2c: Tensor | None, keep: Tensor | None, scaling: float, heads: int
) -> Tensor:
    """In place: scores [g * H, rows, keys] (contiguous) -> probabilities; c2p, p2c: [g, H, rows, keys] views with
    unit stride along keys (c2p) and rows (p2c), or None; keep: uint8 [g, keys] (unit stride) or None.
    Returns the log-sum-exp of each row, [g * H, rows] float32."""
    count, rows, keys = scores.shape
    if c2p is not None and c2p.stride(3) != 1 or p2c is not None and p2c.stride(2) != 1:
        raise ValueError("scores_softmax reads c2p along keys and p2c along rows: both need unit strides there")
    lse = scores.new_empty(count, rows)
    _library.scores_softmax(
        _address(scores),
        scores.stride(0),
        scores.stride(1),
        _address(c2p),
        *((c2p.stride(0), c2p.stride(1), c2p.stride(2)) if c2p is not None else (0, 0, 0)),
        _address(p2c),
        *((p2c.stride(0), p2c.stride(1), p2c.stride(3)) if p2c is not None else (0, 0, 0)),
        _address(keep),
        keep.stride(0) if keep is not None else 0,
        _address(lse),
        count,
        heads,
        rows,
        keys,
        scaling,
        torch.get_num_threads(),
    )
    return lse
