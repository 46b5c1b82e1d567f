/* position_bias.c's vector layer on AVX-512 (F and BW): 16 float32 lanes in one __m512.

   Every function is the intrinsic (or the few) that the kernels called directly before they were written over this
   layer, so that the AVX-512 build compiles to the same instructions. The layer's contract, for each set:

     f32x16          16 float32 lanes;  bf16x16: 16 bfloat16 (rounded, for a store);  mask16: bit t = lane t
     v_zero, v_set1, v_load, v_store, v_add, v_sub, v_mul, v_max, v_fmadd (a b + c), v_fnmadd (c - a b)
     v_load_first(p, n)        lanes 0 .. n - 1 from p, the rest 0; reads only n elements (1 <= n <= 16)
     v_add_into_first(p, v, n) p[t] += v[t] for t < n; touches only those n elements
     v_load_bf16[_first]       the same from bfloat16 (exact: its 16 bits become a float32's high half)
     v_round_bf16(v)           round to nearest even, NaN stays NaN (torch's rounding); b_select, b_store
     v_select(m, fill, v)      fill where m has the lane, else v
     v_permute(v, columns, lowest)   lane t = v[columns[t] - lowest] (0 <= columns[t] - lowest < 16)
     m_zero_bytes(flags)       the lanes whose byte of flags[0 .. 15] is 0
     v_reduce_add, v_reduce_max, v_transpose16 (in place: row r of 16 becomes column r)
     v_round(v)                to the nearest integer, ties to even
     v_times_pow2(v, n)        v 2^n, for integral n in [-126, 127] where the product is a normal number (exact)
     v_zero_below(v, x, limit) v, with 0 in the lanes where x < limit (NaN is not below: it keeps v)
     v_max(a, b)               NaN where b is NaN (x86 returns the second operand where either is NaN)
     PRODUCT_ROWS              rows of a register-blocked product: 16 x 16 sums live in registers at once here
*/

#include <immintrin.h>

#define VECTOR_SET "avx512"
#define PRODUCT_ROWS 16 /* 16 accumulators of 16 lanes: half of AVX-512's 32 registers */

typedef __m512 f32x16;
typedef __m256i bf16x16;
typedef __mmask16 mask16;

static inline f32x16 v_zero(void) { return _mm512_setzero_ps(); }
static inline f32x16 v_set1(float x) { return _mm512_set1_ps(x); }
static inline f32x16 v_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void v_store(float *p, f32x16 v) { _mm512_storeu_ps(p, v); }
static inline f32x16 v_add(f32x16 a, f32x16 b) { return _mm512_add_ps(a, b); }
static inline f32x16 v_sub(f32x16 a, f32x16 b) { return _mm512_sub_ps(a, b); }
static inline f32x16 v_mul(f32x16 a, f32x16 b) { return _mm512_mul_ps(a, b); }
static inline f32x16 v_max(f32x16 a, f32x16 b) { return _mm512_max_ps(a, b); }
static inline f32x16 v_fmadd(f32x16 a, f32x16 b, f32x16 c) { return _mm512_fmadd_ps(a, b, c); }
static inline f32x16 v_fnmadd(f32x16 a, f32x16 b, f32x16 c) { return _mm512_fnmadd_ps(a, b, c); }
static inline f32x16 v_select(mask16 m, f32x16 fill, f32x16 v) { return _mm512_mask_mov_ps(v, m, fill); }
static inline float v_reduce_add(f32x16 v) { return _mm512_reduce_add_ps(v); }
static inline float v_reduce_max(f32x16 v) { return _mm512_reduce_max_ps(v); }

static inline mask16 first_lanes(int n) { return (mask16)((1u << n) - 1u); }

static inline f32x16 v_load_first(const float *p, int n) { return _mm512_maskz_loadu_ps(first_lanes(n), p); }

static inline void v_add_into_first(float *p, f32x16 v, int n) {
    const mask16 span = first_lanes(n);
    _mm512_mask_storeu_ps(p, span, _mm512_add_ps(_mm512_maskz_loadu_ps(span, p), v));
}

static inline f32x16 widen_bf16(__m256i half) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

static inline f32x16 v_load_bf16(const uint16_t *p) { return widen_bf16(_mm256_loadu_si256((const __m256i *)p)); }

static inline f32x16 v_load_bf16_first(const uint16_t *p, int n) {
    return widen_bf16(_mm256_maskz_loadu_epi16(first_lanes(n), p));
}

static inline bf16x16 v_round_bf16(f32x16 value) {
    __m512i u = _mm512_castps_si512(value);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(value, value, _CMP_UNORD_Q);
    __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, quiet));
}

static inline bf16x16 b_select(mask16 m, uint16_t fill, bf16x16 b) {
    return _mm256_mask_mov_epi16(b, m, _mm256_set1_epi16((int16_t)fill));
}

static inline void b_store(uint16_t *p, bf16x16 b) { _mm256_storeu_si256((__m256i *)p, b); }

static inline f32x16 v_permute(f32x16 v, const int32_t *columns, int32_t lowest) {
    const __m512i c = _mm512_loadu_si512((const void *)columns);
    return _mm512_permutexvar_ps(_mm512_sub_epi32(c, _mm512_set1_epi32(lowest)), v);
}

static inline mask16 m_zero_bytes(const uint8_t *flags) {
    return _mm_cmpeq_epi8_mask(_mm_loadu_si128((const __m128i *)flags), _mm_setzero_si128());
}

static inline f32x16 v_round(f32x16 v) {
    return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
static inline f32x16 v_times_pow2(f32x16 v, f32x16 n) { return _mm512_scalef_ps(v, n); }
static inline f32x16 v_zero_below(f32x16 v, f32x16 x, float limit) {
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(limit), _CMP_NLT_UQ), v);
}

/* In place: row r of the 16 x 16 block becomes its column r. */
static inline void v_transpose16(f32x16 m[16]) {
    __m512 t[16];
    for (int r = 0; r < 16; r += 2) { /* pairs of rows, interleaved */
        t[r] = _mm512_unpacklo_ps(m[r], m[r + 1]);
        t[r + 1] = _mm512_unpackhi_ps(m[r], m[r + 1]);
    }
    for (int r = 0; r < 16; r += 4) { /* m[r + s]: rows r .. r + 3 at column 4l + s of each 128-bit lane l */
        for (int h = 0; h < 2; h++) {
            __m512d a = _mm512_castps_pd(t[r + h]), b = _mm512_castps_pd(t[r + h + 2]);
            m[r + 2 * h] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
            m[r + 2 * h + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
        }
    }
    for (int r = 0; r < 16; r += 8) { /* lanes of rows r .. r + 7: columns s, 8 + s | 4 + s, 12 + s */
        for (int s = 0; s < 4; s++) {
            t[r + s] = _mm512_shuffle_f32x4(m[r + s], m[r + s + 4], 0x88);
            t[r + s + 4] = _mm512_shuffle_f32x4(m[r + s], m[r + s + 4], 0xdd);
        }
    }
    for (int s = 0; s < 8; s++) { /* all 16 rows */
        m[s] = _mm512_shuffle_f32x4(t[s], t[s + 8], 0x88);
        m[s + 8] = _mm512_shuffle_f32x4(t[s], t[s + 8], 0xdd);
    }
}
