/* position_bias.c's vector layer on aarch64's Advanced SIMD (NEON, every 64-bit ARM processor: AWS Graviton,
   Ampere Altra, Azure Cobalt, Apple M): the 16 lanes are four float32x4_t quarters. The contract is
   position_bias_avx512.h's.

   NEON has 32 registers of 4 lanes: a register-blocked product keeps 6 rows x 16 columns of sums (24 registers);
   masks are 16-bit integers, turned into lane masks where a blend needs one; masked loads and stores go through a
   small buffer (NEON has none); a permute is a table lookup of bytes over the 64 bytes of the 16 lanes; 2^n is
   built in the exponent bits. */

#include <arm_neon.h>

#define VECTOR_SET "neon"
#define PRODUCT_ROWS 6 /* 6 rows x 4 quarters = 24 accumulators, 4 column loads and a broadcast: 29 of 32
                          registers */

typedef struct {
    float32x4_t q[4];
} f32x16;
typedef struct {
    uint16x8_t h[2];
} bf16x16;
typedef uint16_t mask16;

static inline f32x16 v_zero(void) {
    f32x16 v;
    for (int i = 0; i < 4; i++) v.q[i] = vdupq_n_f32(0.0f);
    return v;
}
static inline f32x16 v_set1(float x) {
    f32x16 v;
    for (int i = 0; i < 4; i++) v.q[i] = vdupq_n_f32(x);
    return v;
}
static inline f32x16 v_load(const float *p) {
    f32x16 v;
    for (int i = 0; i < 4; i++) v.q[i] = vld1q_f32(p + 4 * i);
    return v;
}
static inline void v_store(float *p, f32x16 v) {
    for (int i = 0; i < 4; i++) vst1q_f32(p + 4 * i, v.q[i]);
}

#define LANEWISE(name, expression)                       \
    static inline f32x16 name(f32x16 a, f32x16 b) {      \
        f32x16 v;                                        \
        for (int i = 0; i < 4; i++) v.q[i] = expression; \
        return v;                                        \
    }
LANEWISE(v_add, vaddq_f32(a.q[i], b.q[i]))
LANEWISE(v_sub, vsubq_f32(a.q[i], b.q[i]))
LANEWISE(v_mul, vmulq_f32(a.q[i], b.q[i]))
LANEWISE(v_max, vmaxq_f32(a.q[i], b.q[i]))
#undef LANEWISE

static inline f32x16 v_fmadd(f32x16 a, f32x16 b, f32x16 c) {
    for (int i = 0; i < 4; i++) c.q[i] = vfmaq_f32(c.q[i], a.q[i], b.q[i]);
    return c;
}
static inline f32x16 v_fnmadd(f32x16 a, f32x16 b, f32x16 c) {
    for (int i = 0; i < 4; i++) c.q[i] = vfmsq_f32(c.q[i], a.q[i], b.q[i]);
    return c;
}

/* Bits 4i .. 4i + 3 of `bits` as 4 lanes of all ones or zeros. */
static inline uint32x4_t lanes4(unsigned bits, int i) {
    const uint32x4_t weights = {1, 2, 4, 8};
    return vtstq_u32(vdupq_n_u32(bits >> (4 * i)), weights);
}

static inline f32x16 v_select(mask16 m, f32x16 fill, f32x16 v) {
    for (int i = 0; i < 4; i++) v.q[i] = vbslq_f32(lanes4(m, i), fill.q[i], v.q[i]);
    return v;
}

static inline float v_reduce_add(f32x16 v) {
    return vaddvq_f32(vaddq_f32(vaddq_f32(v.q[0], v.q[1]), vaddq_f32(v.q[2], v.q[3])));
}
static inline float v_reduce_max(f32x16 v) {
    return vmaxvq_f32(vmaxq_f32(vmaxq_f32(v.q[0], v.q[1]), vmaxq_f32(v.q[2], v.q[3])));
}

static inline f32x16 v_load_first(const float *p, int n) {
    if (n == 16) return v_load(p);
    float part[16] = {0};
    memcpy(part, p, (size_t)n * 4);
    return v_load(part);
}

static inline void v_add_into_first(float *p, f32x16 v, int n) {
    if (n == 16) {
        v_store(p, v_add(v_load(p), v));
        return;
    }
    float part[16];
    v_store(part, v);
    for (int t = 0; t < n; t++) p[t] += part[t];
}

static inline f32x16 v_load_bf16(const uint16_t *p) {
    f32x16 v;
    for (int h = 0; h < 2; h++) { /* 16 bits to the high half of 32: exact */
        const uint16x8_t half = vld1q_u16(p + 8 * h);
        v.q[2 * h] = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(half), 16));
        v.q[2 * h + 1] = vreinterpretq_f32_u32(vshll_high_n_u16(half, 16));
    }
    return v;
}

static inline f32x16 v_load_bf16_first(const uint16_t *p, int n) {
    if (n == 16) return v_load_bf16(p);
    uint16_t part[16] = {0};
    memcpy(part, p, (size_t)n * 2);
    return v_load_bf16(part);
}

/* 4 lanes rounded to bfloat16. */
static inline uint16x4_t round4(float32x4_t value) {
    const uint32x4_t u = vreinterpretq_u32_f32(value);
    const uint32x4_t odd = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
    const uint16x4_t rounded = vshrn_n_u32(vaddq_u32(u, vaddq_u32(odd, vdupq_n_u32(0x7fff))), 16);
    const uint16x4_t quiet = vmovn_u32(vorrq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(0x40)));
    const uint16x4_t number = vmovn_u32(vceqq_f32(value, value)); /* all ones where not NaN */
    return vbsl_u16(number, rounded, quiet);
}

static inline bf16x16 v_round_bf16(f32x16 value) {
    bf16x16 b;
    for (int h = 0; h < 2; h++) b.h[h] = vcombine_u16(round4(value.q[2 * h]), round4(value.q[2 * h + 1]));
    return b;
}

static inline bf16x16 b_select(mask16 m, uint16_t fill, bf16x16 b) {
    const uint16x8_t weights = {1, 2, 4, 8, 16, 32, 64, 128};
    for (int h = 0; h < 2; h++)
        b.h[h] = vbslq_u16(vtstq_u16(vdupq_n_u16((uint16_t)(m >> (8 * h))), weights), vdupq_n_u16(fill), b.h[h]);
    return b;
}

static inline void b_store(uint16_t *p, bf16x16 b) {
    vst1q_u16(p, b.h[0]);
    vst1q_u16(p + 8, b.h[1]);
}

static inline f32x16 v_permute(f32x16 v, const int32_t *columns, int32_t lowest) {
    uint8x16x4_t table;
    for (int i = 0; i < 4; i++) table.val[i] = vreinterpretq_u8_f32(v.q[i]);
    const uint32x4_t bytes = vdupq_n_u32(0x03020100u), spread = vdupq_n_u32(0x04040404u);
    f32x16 out;
    for (int i = 0; i < 4; i++) { /* lane t reads bytes 4k .. 4k + 3, k = columns[t] - lowest */
        const uint32x4_t k = vreinterpretq_u32_s32(vsubq_s32(vld1q_s32(columns + 4 * i), vdupq_n_s32(lowest)));
        const uint8x16_t index = vreinterpretq_u8_u32(vmlaq_u32(bytes, k, spread));
        out.q[i] = vreinterpretq_f32_u8(vqtbl4q_u8(table, index));
    }
    return out;
}

static inline mask16 m_zero_bytes(const uint8_t *flags) {
    const uint8x16_t weights = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    const uint8x16_t bits = vandq_u8(vceqzq_u8(vld1q_u8(flags)), weights);
    return (mask16)(vaddv_u8(vget_low_u8(bits)) | (vaddv_u8(vget_high_u8(bits)) << 8));
}

static inline f32x16 v_round(f32x16 v) {
    for (int i = 0; i < 4; i++) v.q[i] = vrndnq_f32(v.q[i]);
    return v;
}

static inline f32x16 v_times_pow2(f32x16 v, f32x16 n) {
    for (int i = 0; i < 4; i++) { /* 2^n from n's bits in the exponent field */
        const int32x4_t exponent = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n.q[i]), vdupq_n_s32(127)), 23);
        v.q[i] = vmulq_f32(v.q[i], vreinterpretq_f32_s32(exponent));
    }
    return v;
}

static inline f32x16 v_zero_below(f32x16 v, f32x16 x, float limit) {
    for (int i = 0; i < 4; i++) /* vcltq_f32 is false for NaN */
        v.q[i] = vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(v.q[i]), vcltq_f32(x.q[i], vdupq_n_f32(limit))));
    return v;
}

/* In place: row r of the 16 x 16 block becomes its column r, as sixteen 4 x 4 blocks: block (I, J) of the rows
   4I .. 4I + 3 and the lanes 4J .. 4J + 3 becomes block (J, I), transposed. */
static inline void v_transpose16(f32x16 m[16]) {
    f32x16 t[16];
    for (int I = 0; I < 4; I++) {
        for (int J = 0; J < 4; J++) {
            const float32x4_t r0 = m[4 * I].q[J], r1 = m[4 * I + 1].q[J], r2 = m[4 * I + 2].q[J], r3 = m[4 * I + 3].q[J];
            const float64x2_t a = vreinterpretq_f64_f32(vtrn1q_f32(r0, r1)), b = vreinterpretq_f64_f32(vtrn2q_f32(r0, r1));
            const float64x2_t c = vreinterpretq_f64_f32(vtrn1q_f32(r2, r3)), d = vreinterpretq_f64_f32(vtrn2q_f32(r2, r3));
            t[4 * J].q[I] = vreinterpretq_f32_f64(vtrn1q_f64(a, c));
            t[4 * J + 1].q[I] = vreinterpretq_f32_f64(vtrn1q_f64(b, d));
            t[4 * J + 2].q[I] = vreinterpretq_f32_f64(vtrn2q_f64(a, c));
            t[4 * J + 3].q[I] = vreinterpretq_f32_f64(vtrn2q_f64(b, d));
        }
    }
    for (int r = 0; r < 16; r++) m[r] = t[r];
}
