/* position_bias.c's vector layer on AVX2 + FMA (x86-64-v3: AMD Zen 1-3, Intel Haswell and later client parts): the
   16 lanes are two __m256 halves, lanes 0 .. 7 and 8 .. 15. The contract is position_bias_avx512.h's.

   Differences the kernels see: AVX2 has 16 vector registers (AVX-512 has 32), so a register-blocked product keeps
   6 rows x 16 columns of sums (12 registers) rather than 16 x 16; masks are 16-bit integers, turned into lane masks
   where a blend or masked load needs one; a masked bfloat16 load goes through a small buffer (AVX2 masks 32-bit
   lanes only); there is no scalef, so 2^n is built in the exponent bits. */

#include <immintrin.h>

#define VECTOR_SET "avx2"
#define PRODUCT_ROWS 6 /* 6 rows x 2 halves = 12 accumulators, 2 column loads and a broadcast: 15 of 16
                          registers (the fused attention timed 20% faster
                          than with 4 rows, and than with 7, which spills, on the AVX2 EPYC) */

typedef struct {
    __m256 lo, hi;
} f32x16;
typedef __m256i bf16x16;
typedef uint16_t mask16;

static inline f32x16 pair(__m256 lo, __m256 hi) {
    f32x16 v = {lo, hi};
    return v;
}

static inline f32x16 v_zero(void) { return pair(_mm256_setzero_ps(), _mm256_setzero_ps()); }
static inline f32x16 v_set1(float x) { return pair(_mm256_set1_ps(x), _mm256_set1_ps(x)); }
static inline f32x16 v_load(const float *p) { return pair(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)); }
static inline void v_store(float *p, f32x16 v) {
    _mm256_storeu_ps(p, v.lo);
    _mm256_storeu_ps(p + 8, v.hi);
}
static inline f32x16 v_add(f32x16 a, f32x16 b) { return pair(_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)); }
static inline f32x16 v_sub(f32x16 a, f32x16 b) { return pair(_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)); }
static inline f32x16 v_mul(f32x16 a, f32x16 b) { return pair(_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)); }
static inline f32x16 v_max(f32x16 a, f32x16 b) { return pair(_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)); }
static inline f32x16 v_fmadd(f32x16 a, f32x16 b, f32x16 c) {
    return pair(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi));
}
static inline f32x16 v_fnmadd(f32x16 a, f32x16 b, f32x16 c) {
    return pair(_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi));
}

/* Bits 0 .. 7 of `bits` as 8 lanes of all ones or zeros. */
static inline __m256 lanes8(unsigned bits) {
    const __m256i weights = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)bits), weights), weights));
}

/* The first n of 8 lanes (n may be below 0 or above 8). */
static inline __m256i first8(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

static inline f32x16 v_select(mask16 m, f32x16 fill, f32x16 v) {
    return pair(_mm256_blendv_ps(v.lo, fill.lo, lanes8(m)), _mm256_blendv_ps(v.hi, fill.hi, lanes8(m >> 8)));
}

static inline float v_reduce_add(f32x16 v) {
    const __m256 s = _mm256_add_ps(v.lo, v.hi);
    __m128 t = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    t = _mm_add_ps(t, _mm_movehl_ps(t, t));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

static inline float v_reduce_max(f32x16 v) {
    const __m256 s = _mm256_max_ps(v.lo, v.hi);
    __m128 t = _mm_max_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    t = _mm_max_ps(t, _mm_movehl_ps(t, t));
    return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
}

static inline f32x16 v_load_first(const float *p, int n) {
    return pair(_mm256_maskload_ps(p, first8(n)), _mm256_maskload_ps(p + 8, first8(n - 8)));
}

static inline void v_add_into_first(float *p, f32x16 v, int n) {
    if (n == 16) {
        v_store(p, v_add(v_load(p), v));
        return;
    }
    const __m256i lo = first8(n), hi = first8(n - 8);
    _mm256_maskstore_ps(p, lo, _mm256_add_ps(_mm256_maskload_ps(p, lo), v.lo));
    _mm256_maskstore_ps(p + 8, hi, _mm256_add_ps(_mm256_maskload_ps(p + 8, hi), v.hi));
}

static inline f32x16 widen_bf16(__m128i lo, __m128i hi) {
    return pair(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(lo), 16)),
                _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(hi), 16)));
}

static inline f32x16 v_load_bf16(const uint16_t *p) {
    return widen_bf16(_mm_loadu_si128((const __m128i *)p), _mm_loadu_si128((const __m128i *)(p + 8)));
}

static inline f32x16 v_load_bf16_first(const uint16_t *p, int n) {
    if (n == 16) return v_load_bf16(p);
    uint16_t part[16] = {0};
    memcpy(part, p, (size_t)n * 2);
    return v_load_bf16(part);
}

/* 8 lanes rounded to bfloat16 in the low 16 bits of each 32-bit lane. */
static inline __m256i round8(__m256 value) {
    const __m256i u = _mm256_castps_si256(value);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    const __m256 nan = _mm256_cmp_ps(value, value, _CMP_UNORD_Q);
    return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(rounded), _mm256_castsi256_ps(quiet), nan));
}

static inline bf16x16 v_round_bf16(f32x16 value) {
    /* packus interleaves the 128-bit lanes (lo 0-3, hi 0-3, lo 4-7, hi 4-7); the permute puts them in order */
    return _mm256_permute4x64_epi64(_mm256_packus_epi32(round8(value.lo), round8(value.hi)), 0xd8);
}

static inline bf16x16 b_select(mask16 m, uint16_t fill, bf16x16 b) {
    const __m256i weights = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
                                              (int16_t)0x8000);
    const __m256i lanes = _mm256_cmpeq_epi16(_mm256_and_si256(_mm256_set1_epi16((int16_t)m), weights), weights);
    return _mm256_blendv_epi8(b, _mm256_set1_epi16((int16_t)fill), lanes);
}

static inline void b_store(uint16_t *p, bf16x16 b) { _mm256_storeu_si256((__m256i *)p, b); }

static inline f32x16 v_permute(f32x16 v, const int32_t *columns, int32_t lowest) {
    const __m256i shift = _mm256_set1_epi32(lowest), seven = _mm256_set1_epi32(7);
    const __m256i lo = _mm256_sub_epi32(_mm256_loadu_si256((const __m256i *)columns), shift);
    const __m256i hi = _mm256_sub_epi32(_mm256_loadu_si256((const __m256i *)(columns + 8)), shift);
    /* each half's lanes from both source halves (permutevar8x32 reads the low 3 bits), then by index > 7 */
    const __m256 lo_from_hi = _mm256_castsi256_ps(_mm256_cmpgt_epi32(lo, seven));
    const __m256 hi_from_hi = _mm256_castsi256_ps(_mm256_cmpgt_epi32(hi, seven));
    return pair(_mm256_blendv_ps(_mm256_permutevar8x32_ps(v.lo, lo), _mm256_permutevar8x32_ps(v.hi, lo), lo_from_hi),
                _mm256_blendv_ps(_mm256_permutevar8x32_ps(v.lo, hi), _mm256_permutevar8x32_ps(v.hi, hi), hi_from_hi));
}

static inline mask16 m_zero_bytes(const uint8_t *flags) {
    const __m128i zero = _mm_cmpeq_epi8(_mm_loadu_si128((const __m128i *)flags), _mm_setzero_si128());
    return (mask16)_mm_movemask_epi8(zero);
}

static inline f32x16 v_round(f32x16 v) {
    return pair(_mm256_round_ps(v.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                _mm256_round_ps(v.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

/* 2^n from n's bits in the exponent field (a normal number for n >= -126). */
static inline __m256 times_pow2(__m256 v, __m256 n) {
    const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(v, _mm256_castsi256_ps(exponent));
}

static inline f32x16 v_times_pow2(f32x16 v, f32x16 n) { return pair(times_pow2(v.lo, n.lo), times_pow2(v.hi, n.hi)); }

static inline f32x16 v_zero_below(f32x16 v, f32x16 x, float limit) {
    const __m256 bound = _mm256_set1_ps(limit);
    return pair(_mm256_andnot_ps(_mm256_cmp_ps(x.lo, bound, _CMP_LT_OQ), v.lo),
                _mm256_andnot_ps(_mm256_cmp_ps(x.hi, bound, _CMP_LT_OQ), v.hi));
}

/* In place: row r of the 8 x 8 block becomes its column r. */
static inline void transpose8(__m256 r[8]) {
    __m256 t[8], s[8];
    for (int i = 0; i < 8; i += 2) { /* pairs of rows, interleaved */
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) { /* columns c and 4 + c of four rows */
        s[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        s[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
        s[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        s[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int c = 0; c < 4; c++) { /* the 128-bit halves of rows 0 .. 3 and 4 .. 7 */
        r[c] = _mm256_permute2f128_ps(s[c], s[c + 4], 0x20);
        r[c + 4] = _mm256_permute2f128_ps(s[c], s[c + 4], 0x31);
    }
}

/* In place: row r of the 16 x 16 block becomes its column r, as four 8 x 8 blocks (the off-diagonal two swap). */
static inline void v_transpose16(f32x16 m[16]) {
    __m256 a[8], b[8], c[8], d[8]; /* rows 0 .. 7 and 8 .. 15, lanes 0 .. 7 and 8 .. 15 */
    for (int r = 0; r < 8; r++) a[r] = m[r].lo, b[r] = m[r].hi, c[r] = m[r + 8].lo, d[r] = m[r + 8].hi;
    transpose8(a);
    transpose8(b);
    transpose8(c);
    transpose8(d);
    for (int r = 0; r < 8; r++) m[r] = pair(a[r], c[r]), m[r + 8] = pair(b[r], d[r]);
}
