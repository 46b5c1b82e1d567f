/* The bias of one block of query rows from the c2p and p2c tables, in one pass (see native.py).

   For query row i = first_row + a and key j = first_key + b, with c = column[i - j + L - 1] the table column of
   the distance i - j (DeBERTa's bucket, shifted and clipped), and W the number of table columns:

       out[p, a, b] = c2p[p, a, W - 1 - c] + p2c[p, b, c]     (or the dtype's minimum where keep[b] is 0)

   c2p (T = q Kr^T, Kr's rows in reverse order) holds the block's rows, p2c (U = k Qr^T) the block's keys; p runs
   over (sequence, head) planes. T's columns are reversed so that along a row of the bias (j ascending, i - j
   descending) both terms read their columns in ascending order: c2p_column[m] = W - 1 - column[2L - 2 - m] at
   m = L - 1 - i + j. Each sum is taken in float32 and rounded once to the output's type, as torch's add does.

   Compiled once on first use by native.py (cc -O3 -march=native -fopenmp). Whole 16 x 16 tiles run with AVX-512,
   the rest one element at a time. In a tile, the 16 columns that 16 consecutive distances read lie within 16
   consecutive table columns (native.py checks it), so each term is one load of 16 columns, permuted where the
   columns are not 16 distinct ones (the log buckets) -- no gathers, which are slow on Xeons with the GDS
   mitigation. c2p is read along the tile's rows; p2c along its columns (one key's 16 rows) and transposed in
   registers. A tile whose every distance reads the table's first or last column (beyond the buckets' reach) is a
   row constant plus a key bias. The planes are shared between OpenMP threads of the runtime PyTorch already
   loaded (libgomp.so.1 is found by its name), so that the kernel and PyTorch's operators never compete for
   cores. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HAVE_AVX512 1
#endif

typedef struct {
    const void *c2p;           /* plane 0, the block's first row; NULL without c2p */
    int64_t c2p_plane, c2p_head, c2p_row;      /* element strides: sequence, head, row */
    const void *p2c;           /* plane 0, key first_key; NULL without p2c */
    int64_t p2c_plane, p2c_head, p2c_row;
    const int32_t *column;     /* [2L - 1]: the p2c column of distance d at d + L - 1 */
    const int32_t *c2p_column; /* [2L - 1]: at m = L - 1 - i + j, the c2p column of distance i - j */
    const uint8_t *keep;       /* [sequences, keys] from first_key, 1 = a key to attend to; NULL: every key */
    int64_t keep_plane;        /* 0 when one mask serves every sequence */
    void *out;                 /* [sequences, heads, rows, keys], contiguous */
    int64_t heads, first_row, rows, first_key, keys, length;
} BiasArgs;

#define LOWEST_F32 (-3.40282346638528859812e+38f)
#define LOWEST_BF16 ((uint16_t)0xff7f)

static inline float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t to_bf16(float f) { /* round to nearest even; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float read(const void *table, int64_t index, int bf16) {
    return bf16 ? from_bf16(((const uint16_t *)table)[index]) : ((const float *)table)[index];
}

#ifdef HAVE_AVX512
/* 16 consecutive elements from `index` on, as float32 (bfloat16: the 16 bits become the high half). */
static inline __m512 load16(const void *table, int64_t index, int bf16) {
    if (bf16) {
        __m256i half = _mm256_loadu_si256((const __m256i *)((const uint16_t *)table + index));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
    }
    return _mm512_loadu_ps((const float *)table + index);
}

/* The 16 table elements of a row (or key) that 16 ascending columns name: one load from the lowest, permuted
   unless the columns are 16 consecutive ones. */
static inline __m512 columns16(const void *table, int64_t row, const int32_t *columns, int bf16) {
    const int32_t lowest = columns[0];
    const __m512 loaded = load16(table, row + lowest, bf16);
    if (columns[15] - lowest == 15) return loaded;
    const __m512i c = _mm512_loadu_si512((const void *)columns);
    return _mm512_permutexvar_ps(_mm512_sub_epi32(c, _mm512_set1_epi32(lowest)), loaded);
}

static inline __m256i round_bf16(__m512 value) {
    __m512i u = _mm512_castps_si512(value);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(value, value, _CMP_UNORD_Q);
    __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, quiet));
}

static inline void store16(void *out, int64_t index, __m512 sum, __mmask16 masked, int bf16) {
    if (bf16) {
        __m256i rounded = round_bf16(sum);
        rounded = _mm256_mask_mov_epi16(rounded, masked, _mm256_set1_epi16((int16_t)LOWEST_BF16));
        _mm256_storeu_si256((__m256i *)((uint16_t *)out + index), rounded);
    } else {
        _mm512_storeu_ps((float *)out + index, _mm512_mask_mov_ps(sum, masked, _mm512_set1_ps(LOWEST_F32)));
    }
}

/* In place: row r of the 16 x 16 block becomes its column r. */
static inline void transpose16(__m512 m[16]) {
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
#endif

/* One (sequence, head) plane. The flags are constants at each call, so that every case compiles on its own. */
static inline __attribute__((always_inline)) void bias_plane(const BiasArgs *args, int64_t sequence, int64_t head,
                                                            const int bf16, const int with_c2p, const int with_p2c) {
    const int64_t size = bf16 ? 2 : 4;
    const char *t = with_c2p ? (const char *)args->c2p + (sequence * args->c2p_plane + head * args->c2p_head) * size : NULL;
    const char *u = with_p2c ? (const char *)args->p2c + (sequence * args->p2c_plane + head * args->p2c_head) * size : NULL;
    const uint8_t *keep = args->keep ? args->keep + sequence * args->keep_plane : NULL;
    char *out = (char *)args->out + (sequence * args->heads + head) * args->rows * args->keys * size;
    const int64_t L = args->length, rows = args->rows, keys = args->keys, c2p_row = args->c2p_row;
    const int32_t *forward = args->column, *c2p_column = args->c2p_column;
    int64_t tiled_rows = 0, tiled_keys = 0;
#ifdef HAVE_AVX512
    tiled_rows = rows / 16 * 16;
    tiled_keys = keys / 16 * 16;
    /* p2c at the table's first and last column for every key (the key bias of the tiles beyond the reach) */
    const int32_t first_column = forward[0], last_column = forward[2 * L - 2];
    float *edges = with_p2c ? malloc(sizeof(float) * 2 * (tiled_keys + 1)) : NULL;
    if (with_p2c && edges == NULL) tiled_rows = tiled_keys = 0; /* out of memory: element by element */
    for (int64_t b = 0; with_p2c && b < tiled_keys; b++) {
        edges[b] = read(u, b * args->p2c_row + first_column, bf16);
        edges[tiled_keys + b] = read(u, b * args->p2c_row + last_column, bf16);
    }
    for (int64_t a0 = 0; a0 < tiled_rows; a0 += 16) {
        const int64_t i0 = args->first_row + a0;
        for (int64_t b0 = 0; b0 < tiled_keys; b0 += 16) {
            const int64_t j0 = args->first_key + b0;
            __mmask16 masked = 0;
            if (keep) masked = _mm_cmpeq_epi8_mask(_mm_loadu_si128((const __m128i *)(keep + b0)), _mm_setzero_si128());
            const int32_t nearest = forward[i0 - (j0 + 15) + L - 1], farthest = forward[i0 + 15 - j0 + L - 1];
            if (nearest == farthest && (nearest == first_column || nearest == last_column)) {
                /* beyond the reach: every distance of the tile reads one column */
                const __m512 key_bias = with_p2c ? _mm512_loadu_ps(edges + (nearest == first_column ? 0 : tiled_keys) + b0)
                                                 : _mm512_setzero_ps();
                const int32_t c2p_at = c2p_column[L - 1 - i0 + j0];
                for (int r = 0; r < 16; r++) {
                    __m512 sum = key_bias;
                    if (with_c2p) {
                        const __m512 constant = _mm512_set1_ps(read(t, (a0 + r) * c2p_row + c2p_at, bf16));
                        sum = with_p2c ? _mm512_add_ps(constant, key_bias) : constant;
                    }
                    store16(out, (a0 + r) * keys + b0, sum, masked, bf16);
                }
                continue;
            }
            __m512 m[16];
            if (with_p2c) { /* key j0 + r over rows i0 .. i0 + 15: distances i - j ascending */
                for (int r = 0; r < 16; r++)
                    m[r] = columns16(u, (b0 + r) * args->p2c_row, forward + (i0 - (j0 + r) + L - 1), bf16);
                transpose16(m);
            }
            for (int r = 0; r < 16; r++) { /* row i0 + r over keys j0 .. j0 + 15 */
                __m512 sum = with_p2c ? m[r] : _mm512_setzero_ps();
                if (with_c2p) {
                    const __m512 c2p = columns16(t, (a0 + r) * c2p_row, c2p_column + (L - 1 - (i0 + r) + j0), bf16);
                    sum = with_p2c ? _mm512_add_ps(c2p, sum) : c2p;
                }
                store16(out, (a0 + r) * keys + b0, sum, masked, bf16);
            }
        }
    }
    free(edges);
#endif
    for (int64_t a = 0; a < rows; a++) { /* what the tiles left: the last rows, and the last keys of every row */
        const int64_t i = args->first_row + a;
        for (int64_t b = a < tiled_rows ? tiled_keys : 0; b < keys; b++) {
            const int64_t j = args->first_key + b;
            float sum = 0.0f;
            if (with_c2p) sum = read(t, a * c2p_row + c2p_column[L - 1 - i + j], bf16);
            if (with_p2c) sum += read(u, b * args->p2c_row + forward[i - j + L - 1], bf16);
            const int dropped = keep && !keep[b];
            if (bf16)
                ((uint16_t *)out)[a * keys + b] = dropped ? LOWEST_BF16 : to_bf16(sum);
            else
                ((float *)out)[a * keys + b] = dropped ? LOWEST_F32 : sum;
        }
    }
}

/* Every (sequence, head) plane, on `threads` OpenMP threads; element_size 2 (bfloat16) or 4 (float32). Returns 1
   for any other size or with neither table. */
int position_bias(const BiasArgs *args, int64_t element_size, int64_t planes, int threads) {
    const int c2p = args->c2p != NULL, p2c = args->p2c != NULL;
    if ((element_size != 2 && element_size != 4) || !(c2p || p2c)) return 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t plane = 0; plane < planes; plane++) {
        const int64_t sequence = plane / args->heads, head = plane % args->heads;
        if (element_size == 2 && c2p && p2c) bias_plane(args, sequence, head, 1, 1, 1);
        else if (element_size == 2 && c2p) bias_plane(args, sequence, head, 1, 1, 0);
        else if (element_size == 2) bias_plane(args, sequence, head, 1, 0, 1);
        else if (c2p && p2c) bias_plane(args, sequence, head, 0, 1, 1);
        else if (c2p) bias_plane(args, sequence, head, 0, 1, 0);
        else bias_plane(args, sequence, head, 0, 0, 1);
    }
    return 0;
}

int has_avx512(void) {
#ifdef HAVE_AVX512
    return 1;
#else
    return 0;
#endif
}
