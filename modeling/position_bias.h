/* What both C libraries compile: the kernels' contract and its checks, the tile code that makes the c2p and p2c
   terms of a 16 x 16 block of scores, and the attention built on it (attend, attend_part), the bias never written.
   Included by position_bias.c (the PyTorch kernels' library, which native.py compiles once on first use: cc -O3
   -fopenmp and the instruction set's flags) and by ONNX Runtime's operator (src/disentangled/serving/ort_attention.c,
   without OpenMP: the pragmas are then ignored), each one translation unit: the code here is compiled into the file
   that includes it. Its entries (ENTRY) are exported names there, or, where the includer defines ENTRY, local to it
   (ort_attention.c's library holds an AVX-512 and an AVX2 unit, whose names must not collide).

   Whole 16 x 16 tiles run with vectors of 16 float32 lanes, the rest one element at a time. The kernels are written
   once over a small vector layer, one header of inline functions per instruction set, chosen by the compiler's
   predefined macros: AVX-512 (position_bias_avx512.h), AVX2 + FMA (position_bias_avx2.h) and aarch64's NEON
   (position_bias_neon.h); position_bias_avx512.h says what each function does, and v_exp below is written once over
   them. The bfloat16 attention on AMX's tiles (position_bias_amx.h) is compiled where the compiler targets AMX.
   Built for no vector set, instruction_set() says "none" and neither library's caller uses the kernels.

   In a tile, the 16 columns that 16 consecutive distances read lie within 16 consecutive table columns (one distance
   more reads the same column or the next: the contract below), so each term is one load of 16 columns, permuted
   where the columns are not 16 distinct ones (the log buckets) -- no gathers, which are slow on Xeons with the GDS
   mitigation. c2p is read along the tile's rows; p2c along its columns (one key's 16 rows) and transposed in
   registers. A tile whose every distance reads the table's first or last column (beyond the buckets' reach) is a
   row constant plus a key bias. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_thread_num(void) { return 0; }
static inline int omp_get_num_threads(void) { return 1; }
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include "position_bias_avx512.h"
#elif defined(__AVX2__) && defined(__FMA__)
#include "position_bias_avx2.h"
#elif defined(__aarch64__) && defined(__ARM_NEON)
#include "position_bias_neon.h"
#endif
#ifdef VECTOR_SET
#define HAVE_VECTORS 1
#endif
/* AMX's macros: __AMX_TILE__ (gcc, newer clang) or __AMXTILE__ (clang before 16); position_bias_amx.h is included
   below, after the code it builds on */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && \
    (defined(__AMX_TILE__) || defined(__AMXTILE__)) && (defined(__AMX_BF16__) || defined(__AMXBF16__))
#define HAVE_AMX 1
#endif
/* The entries native.py and ort_attention.c call by name (see above). */
#ifndef ENTRY
#define ENTRY
#endif

#ifdef HAVE_VECTORS
/* e^x in float32 for x <= 0: 2^n e^r with n = round(x / ln 2), r = x - n ln 2 in two parts, e^r by its Taylor
   polynomial to r^6 (|r| <= ln 2 / 2: relative error under 2e-7). Below -87 (-inf included) it is exactly 0: the
   result would be subnormal there, and arithmetic on subnormals takes the processor's slow path. NaN stays NaN (the
   clamp is max with x as its second operand, and v_zero_below keeps NaN lanes), so that a NaN score reaches the
   sum. */
static inline f32x16 v_exp(f32x16 x) {
    const f32x16 clamped = v_max(v_set1(-87.0f), x);
    const f32x16 n = v_round(v_mul(clamped, v_set1(1.44269504088896341f)));
    f32x16 r = v_fnmadd(n, v_set1(0.693145751953125f), clamped);
    r = v_fnmadd(n, v_set1(1.42860682030941723212e-6f), r);
    f32x16 p = v_set1(1.0f / 720);
    p = v_fmadd(p, r, v_set1(1.0f / 120));
    p = v_fmadd(p, r, v_set1(1.0f / 24));
    p = v_fmadd(p, r, v_set1(1.0f / 6));
    p = v_fmadd(p, r, v_set1(0.5f));
    p = v_fmadd(p, r, v_set1(1.0f));
    p = v_fmadd(p, r, v_set1(1.0f));
    return v_zero_below(v_times_pow2(p, n), x, -87.0f);
}
#endif

/* ---- What every entry assumes of its arguments (here and in position_bias.c): the contract, checked by each entry
   before it reads ----

   Each exported function (position_bias, hankel_bias, hankel_bias_backward, attend, attend_part) refuses, with
   COLUMNS_REFUSED, arguments that break the first two rules; the callers (native.py's wrappers, which build the
   structs from PyTorch tensors, and ort_attention.c, which checks an ONNX graph's inputs and names the one at fault)
   own the third.
   1. Column vectors. Each of its `count` entries is a table column in [0, W); they ascend (the column never falls as
      the distance grows: every bucketing does so); where whole tiles run with vectors, each entry is at most one
      column past the one before it, so that 16 consecutive entries lie within 16 consecutive columns and, where they
      span all 16, are those 16 in order (a tile's one load of 16 columns, `columns16`, used as loaded then).
      c2p_column, where there is one, ascends as well and is column's mirror: c2p_column[m] + column[count - 1 - m] is
      one number for every m (so that a tile beyond the buckets' reach reads one column of each table).
   2. Extents. length >= 1, W >= 1, heads >= 1; the rows [first_row, first_row + rows) and the keys [first_key,
      first_key + keys) lie inside [0, length).
   3. Memory. Pointers and strides describe buffers that hold what they name, tables with 15 spare elements after
      them where position_bias reads 16 columns at a time; attend's workspace has workspace_bytes(keys, W) per
      thread.
   A second line behind the first: the table products clamp the columns they make to [0, W) (columns_read), so that
   a caller's mistake reads less and writes nothing outside the tables. */

#define COLUMNS_REFUSED 4
enum { COLUMN_HOLDS, COLUMN_OUTSIDE, COLUMN_FALLS, COLUMN_STEPS_OVER_ONE, COLUMN_NOT_MIRRORED };

/* Rule 1 for one vector of `count` entries: COLUMN_HOLDS, or the first rule broken and, in *at, the entry at fault. */
ENTRY int column_fault(const int32_t *column, int64_t count, int64_t width, int64_t tiled, int64_t *at) {
    for (int64_t m = 0; m < count; m++) {
        *at = m;
        if (column[m] < 0 || column[m] >= width) return COLUMN_OUTSIDE;
        if (m > 0 && column[m] < column[m - 1]) return COLUMN_FALLS;
        if (tiled && m > 0 && column[m] - column[m - 1] > 1) return COLUMN_STEPS_OVER_ONE;
    }
    *at = -1;
    return COLUMN_HOLDS;
}

/* Whether c2p_column is column's mirror (rule 1): COLUMN_HOLDS, or COLUMN_NOT_MIRRORED with *at the first m where
   the sum differs from the first. */
ENTRY int mirror_fault(const int32_t *column, const int32_t *c2p_column, int64_t count, int64_t *at) {
    for (int64_t m = 0; m < count; m++) {
        *at = m;
        if ((int64_t)c2p_column[m] + column[count - 1 - m] != (int64_t)c2p_column[0] + column[count - 1])
            return COLUMN_NOT_MIRRORED;
    }
    *at = -1;
    return COLUMN_HOLDS;
}

/* What each fault breaks, in words (for the errors of native.py and ort_attention.c). */
ENTRY const char *column_rule(int fault) {
    switch (fault) {
    case COLUMN_HOLDS: return "holds";
    case COLUMN_OUTSIDE: return "lies outside the table's columns [0, W)";
    case COLUMN_FALLS: return "is below the entry before it (the columns must ascend with the distance)";
    case COLUMN_STEPS_OVER_ONE: return "is more than one column past the entry before it (for the tiles, one distance "
                                       "more reads the same column or the next)";
    default: return "breaks the mirror rule (c2p_column[m] + column[2L - 2 - m] must be one number for every m)";
    }
}

/* Rules 1 and 2 for the [2L - 1] columns of position_bias and attend: 0 if they hold. */
static inline int columns_refused(const int32_t *column, const int32_t *c2p_column, int64_t length, int64_t width,
                                  int64_t first_row, int64_t rows, int64_t first_key, int64_t keys) {
    int64_t at;
    if (length < 1 || width < 1 || first_row < 0 || rows < 0 || first_row > length - rows || first_key < 0 ||
        keys < 0 || first_key > length - keys || length > INT32_MAX)
        return 1;
    return column_fault(column, 2 * length - 1, width, 1, &at) || column_fault(c2p_column, 2 * length - 1, width, 1, &at) ||
           mirror_fault(column, c2p_column, 2 * length - 1, &at);
}

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

static inline float element(const void *table, int64_t index, int bf16) {
    return bf16 ? from_bf16(((const uint16_t *)table)[index]) : ((const float *)table)[index];
}

#ifdef HAVE_VECTORS
/* 16 consecutive elements from `index` on, as float32 (bfloat16: the 16 bits become the high half). */
static inline f32x16 load16(const void *table, int64_t index, int bf16) {
    return bf16 ? v_load_bf16((const uint16_t *)table + index) : v_load((const float *)table + index);
}

/* The 16 table elements of a row (or key) that 16 ascending columns name: one load from the lowest, permuted
   unless the columns are 16 consecutive ones. The load takes 16 elements (the tables of position_bias and attend
   have 15 spare after them), or, `to_last`, stops at the last column named (the training tables have none). */
static inline __attribute__((always_inline)) f32x16 columns16(const void *table, int64_t row, const int32_t *columns,
                                                              int bf16, const int to_last) {
    const int32_t lowest = columns[0];
    const int span = columns[15] - lowest + 1;
    f32x16 loaded;
    if (!to_last) loaded = load16(table, row + lowest, bf16);
    else if (bf16) loaded = v_load_bf16_first((const uint16_t *)table + row + lowest, span);
    else loaded = v_load_first((const float *)table + row + lowest, span);
    if (span == 16) return loaded;
    return v_permute(loaded, columns, lowest);
}

static inline void store16(void *out, int64_t index, f32x16 sum, mask16 masked, int bf16) {
    if (bf16) b_store((uint16_t *)out + index, b_select(masked, LOWEST_BF16, v_round_bf16(sum)));
    else v_store((float *)out + index, v_select(masked, v_set1(LOWEST_F32), sum));
}
#endif

/* One plane's two tables, as a tile of the bias reads them. */
typedef struct {
    const char *t, *u;         /* c2p at the block's first row, p2c at key first_key; NULL without that term */
    int64_t t_row, u_row;      /* element strides between rows of T and of U */
    const int32_t *forward, *c2p_column;
    int64_t length, first_row, first_key;
    const float *edges;        /* p2c at the first, then at the last column, of each tiled key ([2, edge_keys]) */
    int64_t edge_keys;
} Terms;

/* The bias of one pair, element by element (the tiles' edges). */
static inline float bias_at(const Terms *s, int64_t a, int64_t b, const int bf16) {
    const int64_t i = s->first_row + a, j = s->first_key + b, L = s->length;
    float sum = 0.0f;
    if (s->t) sum = element(s->t, a * s->t_row + s->c2p_column[L - 1 - i + j], bf16);
    if (s->u) sum += element(s->u, b * s->u_row + s->forward[i - j + L - 1], bf16);
    return sum;
}

#ifdef HAVE_VECTORS
/* p2c at the table's first and last column for each of the first `keys` keys, into edges[0 .. 2 keys). */
static void fill_edges(Terms *s, float *edges, int64_t keys, const int bf16) {
    const int32_t first_column = s->forward[0], last_column = s->forward[2 * s->length - 2];
    for (int64_t b = 0; s->u && b < keys; b++) {
        edges[b] = element(s->u, b * s->u_row + first_column, bf16);
        edges[keys + b] = element(s->u, b * s->u_row + last_column, bf16);
    }
    s->edges = edges;
    s->edge_keys = keys;
}

/* Whether the distances from column `from` to column `to` are all beyond the buckets' reach: one column, the
   table's first or its last. */
static inline int beyond_reach(const Terms *s, int32_t from, int32_t to) {
    return from == to && (from == s->forward[0] || from == s->forward[2 * s->length - 2]);
}

/* m[r] = c2p + p2c of row a0 + r against keys b0 .. b0 + 15: a whole tile inside the tables, each sum in float32.
   The flags are constants at each call, so that every case compiles on its own. */
static inline __attribute__((always_inline)) void bias_tile(const Terms *s, int64_t a0, int64_t b0, f32x16 m[16],
                                                           const int bf16, const int with_c2p, const int with_p2c) {
    const int64_t L = s->length, i0 = s->first_row + a0, j0 = s->first_key + b0;
    const int32_t *forward = s->forward;
    const int32_t nearest = forward[i0 - (j0 + 15) + L - 1], farthest = forward[i0 + 15 - j0 + L - 1];
    if (beyond_reach(s, nearest, farthest)) {
        /* beyond the reach: every distance of the tile reads one column, a row constant plus a key bias */
        const f32x16 key_bias = with_p2c ? v_load(s->edges + (nearest == forward[0] ? 0 : s->edge_keys) + b0) : v_zero();
        const int32_t c2p_at = s->c2p_column[L - 1 - i0 + j0];
        for (int r = 0; r < 16; r++) {
            m[r] = key_bias;
            if (with_c2p) {
                const f32x16 constant = v_set1(element(s->t, (a0 + r) * s->t_row + c2p_at, bf16));
                m[r] = with_p2c ? v_add(constant, key_bias) : constant;
            }
        }
        return;
    }
    if (with_p2c) { /* key j0 + r over rows i0 .. i0 + 15: distances i - j ascending */
        for (int r = 0; r < 16; r++)
            m[r] = columns16(s->u, (b0 + r) * s->u_row, forward + (i0 - (j0 + r) + L - 1), bf16, 0);
        v_transpose16(m);
    }
    for (int r = 0; r < 16; r++) { /* row i0 + r over keys j0 .. j0 + 15 */
        if (!with_c2p) continue;
        const f32x16 c2p = columns16(s->t, (a0 + r) * s->t_row, s->c2p_column + (L - 1 - (i0 + r) + j0), bf16, 0);
        m[r] = with_p2c ? v_add(c2p, m[r]) : c2p;
    }
}
#endif

/* ---- Attention with the position terms made inside the tile (bfloat16 on AMX, position_bias_amx.h; float32) ----

   attend() computes, for each (sequence, head) plane and query row i, over the keys j of [first_key, first_key + keys):

       out_i = sum_j softmax_j(scale q_i . k_j + c2p[i, j] + p2c[i, j]) v_j      (keys whose keep is 0 left out)

   with c2p[i, j] = q_i . Kr[c(i - j)] and p2c[i, j] = k_j . Qr[c(i - j)] (Kr and Qr scaled already), the bias never
   written to memory. Each thread takes one plane at a time and makes its tables in float32 on the AMX tiles: U = k
   Qr^T for the plane's keys, then, for each block of 16 query rows, T = q Kr^T of those rows, so that both stay in
   cache; the tile code above (bias_tile, position_bias()'s) then reads them exactly as it reads position_bias()'s.
   Flash attention's order: for each block of 16 query rows, blocks of KEY_BLOCK keys in turn, with a running maximum
   and sum per row (the online softmax). The products q k^T and p v run on the AMX tiles in bfloat16 with float32
   sums; the scores, the softmax and the context stay in float32 until the context is rounded once to bfloat16. A row
   whose every key is left out comes out 0 (the caller handles a sequence of padding).

   Tiles (16 rows of 64 bytes each): 0-3 float32 sums (16 x 16 scores, table columns or context columns), 4-5 the
   first operand (16 rows of 32 bfloat16: queries, keys or weights), 6-7 the second. AMX's second operand holds pairs
   of bfloat16 along its rows (the "VNNI" layout), so keys, values and the relative rows are packed first: a key
   tile's row r holds dimensions 2r, 2r + 1 of 16 keys (the transpose of their rows read as 32-bit pairs), a value
   tile's row r keys 2r, 2r + 1 of 16 dimensions. Kr (rows reversed) and Qr come packed as key tiles. */

typedef struct {
    const uint16_t *query, *key, *value; /* [sequences, heads, length, 64] bfloat16 (float32: read as float) */
    int64_t query_sequence, query_head, query_row;
    int64_t key_sequence, key_head, key_row;
    int64_t value_sequence, value_head, value_row;
    uint16_t *out;                       /* [sequences, length, heads, 64] at its strides */
    int64_t out_sequence, out_head, out_row;
    const uint32_t *pos_key;             /* Kr, rows reversed, as key tiles: [heads, width / 16, 2, 16, 16] pairs
                                            (float32: [heads, width / 16, 64, 16]); or NULL */
    const uint32_t *pos_query;           /* Qr as key tiles; or NULL */
    int64_t width;                       /* W, the table columns, a multiple of 16 */
    const int32_t *column, *c2p_column;  /* as position_bias reads them */
    const uint8_t *keep;                 /* [sequences, keys] from first_key, 1 = a key to attend to; or NULL */
    int64_t keep_sequence;               /* 0 when one mask serves every sequence */
    int64_t heads, length, first_key, keys;
    float scale;
    void *workspace;                     /* workspace_bytes(keys, width) for each thread */
} AttendArgs;

#define QUERY_ROWS 16
#define KEY_BLOCK 128
#define DIM 64
#define ROW_GROUP 8 /* blocks of 16 rows per sweep over the keys (attend_rows, attend_rows_f32) */

static int64_t padded_keys(int64_t keys) { return (keys + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK; }

/* Bytes of a thread's packed keys and values: padded keys x 64 dimensions x 2 (keys, values) x 4 (float32; bfloat16
   uses half of them). */
static int64_t packed_bytes(int64_t padded) { return padded * DIM * 2 * 4; }

/* One thread's workspace: the plane's packed keys and values, U ([padded keys, W] float32) and its edge columns,
   and the T of a group of blocks of rows ([ROW_GROUP x 16, W] float32), each table with 16 spare elements (the
   tile loads read 16 columns). */
ENTRY int64_t workspace_bytes(int64_t keys, int64_t width) {
    const int64_t padded = padded_keys(keys);
    return packed_bytes(padded) + (padded * width + 16) * 4 + padded * 2 * 4 + (ROW_GROUP * QUERY_ROWS * width + 16) * 4 + 64;
}

#ifdef HAVE_VECTORS
/* Keys b0 .. b0 + 15 of 16 score rows (row stride KEY_BLOCK) holding q . k: scale them and add the position terms
   (rows and keys past the last take the element-by-element edge), -inf for the keys past the last and those that
   keep leaves out. */
static inline void add_position_terms(const Terms *s, float *tile, int64_t b0, int64_t rows, int64_t keys,
                                      const uint8_t *keep, float scale) {
    if (b0 >= keys) {
        for (int r = 0; r < 16; r++) v_store(tile + r * KEY_BLOCK, v_set1(-INFINITY));
        return;
    }
    mask16 out = b0 + 16 > keys ? (mask16)(0xffff << (keys - b0)) : 0; /* past the last key */
    if (keep) {
        if (b0 + 16 <= keys) {
            out |= m_zero_bytes(keep + b0);
        } else {
            uint8_t flags[16] = {0};
            memcpy(flags, keep + b0, (size_t)(keys - b0));
            out |= m_zero_bytes(flags);
        }
    }
    if (rows == QUERY_ROWS && b0 + 16 <= keys / 16 * 16) {
        f32x16 m[16];
        if (s->t && s->u) bias_tile(s, 0, b0, m, 0, 1, 1);
        else if (s->t) bias_tile(s, 0, b0, m, 0, 1, 0);
        else bias_tile(s, 0, b0, m, 0, 0, 1);
        for (int r = 0; r < 16; r++) {
            const f32x16 v = v_fmadd(v_load(tile + r * KEY_BLOCK), v_set1(scale), m[r]);
            v_store(tile + r * KEY_BLOCK, v_select(out, v_set1(-INFINITY), v));
        }
        return;
    }
    for (int r = 0; r < 16; r++) /* an edge: element by element */
        for (int c = 0; c < 16; c++) {
            float *score = tile + r * KEY_BLOCK + c;
            if ((out >> c) & 1) *score = -INFINITY;
            else *score = *score * scale + (r < rows ? bias_at(s, r, b0 + c, 0) : 0.0f);
        }
}

/* The columns [first, last) of a table, in whole tiles of 16, that a block reads: `columns` by m ascending (the
   column never decreases with m), m from m_low to m_high clamped to the 2L - 1 distances. At short inputs a block
   reads fewer columns than the table has (16 rows against 128 keys: 143 of 255), and only those are made. The
   contract's second line: [first, last) is clamped to [0, W), so that no column vector makes a product write
   outside the table. */
static inline void columns_read(const int32_t *columns, int64_t m_low, int64_t m_high, int64_t length, int64_t width,
                                int64_t *first, int64_t *last) {
    m_low = m_low < 0 ? 0 : m_low;
    m_high = m_high > 2 * length - 2 ? 2 * length - 2 : m_high;
    const int64_t low = columns[m_low] < 0 ? 0 : columns[m_low] / 16 * 16, high = (int64_t)columns[m_high] + 16;
    *first = low < width ? low : width;
    *last = high / 16 * 16 < width ? high / 16 * 16 : width;
    *last = *last < *first ? *first : *last;
}

/* T's columns that rows a0 .. a0 + 15 read (c2p_column at m = L - 1 - i + j) over the keys [first_key, first_key +
   keys), and U's that keys b0 .. b0 + 15 read (column at m = i - j + L - 1) over the rows [row_first, row_last). */
static inline void t_columns(const AttendArgs *x, int64_t a0, int64_t *first, int64_t *last) {
    const int64_t L = x->length;
    columns_read(x->c2p_column, L - 1 - (a0 + 15) + x->first_key, L - 1 - a0 + x->first_key + x->keys - 1, L,
                 x->width, first, last);
}

static inline void u_columns(const AttendArgs *x, int64_t b0, int64_t row_first, int64_t row_last, int64_t *first,
                             int64_t *last) {
    const int64_t L = x->length, j = x->first_key + b0;
    columns_read(x->column, row_first - (j + 15) + L - 1, row_last - 1 - j + L - 1, L, x->width, first, last);
}

/* The online softmax over one block of 16 x KEY_BLOCK scores: weights = e^(score - running maximum), in bfloat16 or
   float32; the running maximum and sum of each row; and the factor that rescales the row's context so far. */
static inline __attribute__((always_inline)) void online_softmax(const float *scores, float *maximum, float *total,
                                                                float *rescale, void *weights, const int bf16) {
    (void)bf16; /* bfloat16 weights only with AMX */
    for (int r = 0; r < QUERY_ROWS; r++) {
        const float *row = scores + r * KEY_BLOCK;
        f32x16 v[KEY_BLOCK / 16], highest = v_set1(-INFINITY);
        for (int c = 0; c < KEY_BLOCK / 16; c++) {
            v[c] = v_load(row + 16 * c);
            highest = v_max(highest, v[c]);
        }
        const float block_highest = v_reduce_max(highest);
        const float updated = block_highest > maximum[r] ? block_highest : maximum[r];
        /* 0, not a subnormal, where the maximum rose by more than 87 (see v_exp) */
        rescale[r] = updated == -INFINITY ? 1.0f : maximum[r] - updated < -87.0f ? 0.0f : expf(maximum[r] - updated);
        maximum[r] = updated;
        const f32x16 shift = v_set1(updated == -INFINITY ? 0.0f : updated);
        f32x16 sum = v_zero();
        for (int c = 0; c < KEY_BLOCK / 16; c++) {
            const f32x16 w = v_exp(v_sub(v[c], shift));
            sum = v_add(sum, w);
#ifdef HAVE_AMX /* bfloat16 weights for AMX's products (bf16 is 0 without AMX) */
            if (bf16) {
                _mm256_storeu_si256((__m256i *)((uint16_t *)weights + r * KEY_BLOCK + 16 * c), (__m256i)_mm512_cvtneps_pbh(w));
                continue;
            }
#endif
            v_store((float *)weights + r * KEY_BLOCK + 16 * c, w);
        }
        total[r] = total[r] * rescale[r] + v_reduce_add(sum);
    }
}

/* What a group of up to ROW_GROUP blocks of 16 rows keeps over its one sweep of the keys (attend_rows in bfloat16,
   attend_rows_f32 in float32): each block's rows, running maxima and sums, and context in float32. Sweeping the
   keys once per group rather than once per block reads each block of 128 packed keys and values from memory once
   per 128 rows (at 4,096 tokens a plane's keys and values are 2 MiB in float32, an L2 cache). */
typedef struct {
    int64_t first_row, count, rows[ROW_GROUP];
    float maximum[ROW_GROUP][QUERY_ROWS], total[ROW_GROUP][QUERY_ROWS];
    float context[ROW_GROUP][QUERY_ROWS * DIM] __attribute__((aligned(64)));
} Group;

static void start_group(Group *group, int64_t a0, int64_t count, int64_t length) {
    group->first_row = a0;
    group->count = count;
    for (int64_t g = 0; g < count; g++) {
        const int64_t first_row = a0 + g * QUERY_ROWS;
        group->rows[g] = length - first_row < QUERY_ROWS ? length - first_row : QUERY_ROWS;
        for (int r = 0; r < QUERY_ROWS; r++) group->maximum[g][r] = -INFINITY, group->total[g][r] = 0.0f;
        memset(group->context[g], 0, sizeof(group->context[g]));
    }
}

/* Block g's scores against keys k0 .. k0 + KEY_BLOCK - 1 (q k^T, in `scores`): scaled, plus the position terms
   (the block's T in `tables`), the keys left out at -inf; then the online softmax into `weights` and `rescale`. */
static inline __attribute__((always_inline)) void softmax_block(Group *group, int64_t g, const AttendArgs *x,
                                                               Terms *s, const float *tables, int64_t k0,
                                                               const uint8_t *keep, float *scores, float *rescale,
                                                               void *weights, const int bf16) {
    s->first_row = group->first_row + g * QUERY_ROWS;
    if (x->pos_key) s->t = (const char *)(tables + g * QUERY_ROWS * x->width);
    for (int64_t b0 = k0; b0 < k0 + KEY_BLOCK; b0 += 16)
        add_position_terms(s, scores + (b0 - k0), b0, group->rows[g], x->keys, keep, x->scale);
    online_softmax(scores, group->maximum[g], group->total[g], rescale, weights, bf16);
}

/* The group's context divided by each row's sum (0 for a row with no key), into `out` in its dtype. */
static void finish_group(const Group *group, const AttendArgs *x, int64_t sequence, int64_t head, const int bf16) {
    for (int64_t g = 0; g < group->count; g++) {
        const int64_t at = sequence * x->out_sequence + head * x->out_head + (group->first_row + g * QUERY_ROWS) * x->out_row;
        for (int64_t r = 0; r < group->rows[g]; r++) {
            /* 0 for a row with no key; a NaN sum (a NaN score) stays NaN, as PyTorch's softmax */
            const f32x16 inverse = v_set1(group->total[g][r] != 0.0f ? 1.0f / group->total[g][r] : 0.0f);
            for (int c = 0; c < DIM; c += 16) {
                const f32x16 value = v_mul(v_load(group->context[g] + r * DIM + c), inverse);
                if (bf16) b_store(x->out + at + r * x->out_row + c, v_round_bf16(value));
                else v_store((float *)x->out + at + r * x->out_row + c, value);
            }
        }
    }
}

#endif

#ifdef HAVE_AMX
#include "position_bias_amx.h"
#endif

/* ---- The same attention in float32, with vector products (no AMX) ----

   The same tile code; q k^T, p v, T and U are products of 16 rows against 16 columns, PRODUCT_ROWS rows at a time
   with their sums in registers (one broadcast and one fused multiply-add per row and dimension), the keys packed as 16-key columns
   ([keys / 16][64][16]), the values copied into rows of 64; and ROW_GROUP blocks of 16 rows share each sweep over
   the keys (a plane's keys and values, twice bfloat16's, outgrow the L2 cache from about 4,096 tokens). */

#ifdef HAVE_VECTORS
/* out[r * stride + c] = a[r] . b[:, c] for `rows` rows of a (64 floats each) and the 16 columns of b ([64][16]), the
   sums in registers (`rows`, at most 16, is a constant at each call). */
static inline __attribute__((always_inline)) void product_rows(const float *a, const float *b, float *out, int64_t stride,
                                                              const int rows) {
    f32x16 acc[16];
    for (int r = 0; r < rows; r++) acc[r] = v_zero();
    for (int d = 0; d < DIM; d++) {
        const f32x16 column = v_load(b + 16 * d);
        for (int r = 0; r < rows; r++) acc[r] = v_fmadd(v_set1(a[r * DIM + d]), column, acc[r]);
    }
    for (int r = 0; r < rows; r++) v_store(out + r * stride, acc[r]);
}

/* The same for 16 rows, PRODUCT_ROWS at a time (all 16 with AVX-512), then the rows left. */
static inline __attribute__((always_inline)) void product16(const float *a, const float *b, float *out, int64_t stride) {
    int r0 = 0;
    for (; r0 + PRODUCT_ROWS <= 16; r0 += PRODUCT_ROWS) product_rows(a + r0 * DIM, b, out + r0 * stride, stride, PRODUCT_ROWS);
    if (16 % PRODUCT_ROWS) product_rows(a + r0 * DIM, b, out + r0 * stride, stride, 16 % PRODUCT_ROWS);
}

/* context[r] = context[r] * rescale[r] + weights[r] v for `rows` rows (a constant at each call) and the 16 dimensions
   from t, over `keys` keys: the sums in registers. */
static inline __attribute__((always_inline)) void weigh_rows(float *context, const float *rescale, const float *weights,
                                                            const float *v, int64_t keys, const int rows) {
    f32x16 acc[16];
    for (int r = 0; r < rows; r++) acc[r] = v_mul(v_load(context + r * DIM), v_set1(rescale[r]));
    for (int64_t k = 0; k < keys; k++) {
        const f32x16 value = v_load(v + k * DIM);
        for (int r = 0; r < rows; r++) acc[r] = v_fmadd(v_set1(weights[r * KEY_BLOCK + k]), value, acc[r]);
    }
    for (int r = 0; r < rows; r++) v_store(context + r * DIM, acc[r]);
}

static void copy_rows_f32(const float *rows, int64_t stride, int64_t count, float *into) {
    for (int r = 0; r < 16; r++)
        for (int c = 0; c < DIM; c += 16)
            v_store(into + r * DIM + c, r < count ? v_load(rows + r * stride + c) : v_zero());
}

/* out[16][width] at columns [first, last) = a (16 x 64) against rows packed [width / 16][64][16] */
static void table_rows_f32(const float *a, const float *packed, int64_t width, float *out, int64_t first, int64_t last) {
    for (int64_t c0 = first; c0 < last; c0 += 16) product16(a, packed + c0 * DIM, out + c0, width);
}

static void pack_plane_f32(const AttendArgs *x, int64_t sequence, int64_t head, int64_t row_first, int64_t row_last,
                           char *workspace, Terms *s) {
    const int64_t keys = x->keys, padded = padded_keys(keys), width = x->width;
    float *key_tiles = (float *)workspace; /* [padded / 16][64][16] */
    float *value_rows = key_tiles + padded * DIM; /* [padded][64] */
    float *u = (float *)(workspace + packed_bytes(padded));
    const float *k = (const float *)x->key + sequence * x->key_sequence + head * x->key_head + x->first_key * x->key_row;
    const float *v = (const float *)x->value + sequence * x->value_sequence + head * x->value_head + x->first_key * x->value_row;
    __attribute__((aligned(64))) float rows[16 * DIM];
    for (int64_t j0 = 0; j0 < padded; j0 += 16) {
        /* the values in rows of 64 (read where they are, a key's row of one head lies a row of every head apart in
           the model's [B, L, H, 64] layout, so that p v would stride over pages) */
        copy_rows_f32(v + j0 * x->value_row, x->value_row, keys - j0, value_rows + j0 * DIM);
        copy_rows_f32(k + j0 * x->key_row, x->key_row, keys - j0, rows);
        for (int q = 0; q < 4; q++) { /* dimensions 16q .. 16q + 15 */
            f32x16 m[16];
            for (int n = 0; n < 16; n++) m[n] = v_load(rows + n * DIM + 16 * q);
            v_transpose16(m);
            for (int r = 0; r < 16; r++) v_store(key_tiles + (j0 / 16) * DIM * 16 + (16 * q + r) * 16, m[r]);
        }
        if (x->pos_query && j0 < keys) { /* U of these 16 keys */
            int64_t first, last;
            u_columns(x, j0, row_first, row_last, &first, &last);
            table_rows_f32(rows, (const float *)x->pos_query + head * width * DIM, width, u + j0 * width, first, last);
        }
    }
    if (x->pos_query) fill_edges(s, u + padded * width + 16, keys / 16 * 16, 0);
}

/* Rows [a0, a0 + 16 count) of one plane (fewer at the end), count <= ROW_GROUP blocks of 16 in one sweep over the
   keys and values packed in `workspace` (a Group); `tables` holds each block's T ([16, W], one after another). */
static void attend_rows_f32(const AttendArgs *x, int64_t sequence, int64_t head, int64_t a0, int64_t count,
                            char *workspace, Terms *s, float *tables) {
    const int64_t keys = x->keys, width = x->width;
    const float *key_tiles = (const float *)workspace, *v = key_tiles + padded_keys(keys) * DIM;
    const uint8_t *keep = x->keep ? x->keep + sequence * x->keep_sequence : NULL;
    __attribute__((aligned(64))) float query[ROW_GROUP][QUERY_ROWS * DIM];
    __attribute__((aligned(64))) float scores[QUERY_ROWS * KEY_BLOCK], weights[QUERY_ROWS * KEY_BLOCK];
    Group group;
    start_group(&group, a0, count, x->length);
    for (int64_t g = 0; g < count; g++) {
        copy_rows_f32((const float *)x->query + sequence * x->query_sequence + head * x->query_head +
                          (a0 + g * QUERY_ROWS) * x->query_row,
                      x->query_row, group.rows[g], query[g]);
        if (x->pos_key) {
            int64_t first, last;
            t_columns(x, a0 + g * QUERY_ROWS, &first, &last);
            table_rows_f32(query[g], (const float *)x->pos_key + head * width * DIM, width, tables + g * QUERY_ROWS * width,
                           first, last);
        }
    }
    for (int64_t k0 = 0; k0 < keys; k0 += KEY_BLOCK) {
        const int64_t count_keys = keys - k0 < KEY_BLOCK ? keys - k0 : KEY_BLOCK;
        for (int64_t g = 0; g < count; g++) {
            /* scores = q k^T, 16 keys at a time */
            for (int64_t b0 = k0; b0 < k0 + count_keys; b0 += 16)
                product16(query[g], key_tiles + (b0 / 16) * DIM * 16, scores + (b0 - k0), KEY_BLOCK);
            float rescale[QUERY_ROWS];
            softmax_block(&group, g, x, s, tables, k0, keep, scores, rescale, weights, 0);
            /* context = context * rescale + weights v, PRODUCT_ROWS rows (then the rows left) and 16 dimensions at a
               time */
            float *context = group.context[g];
            int r0 = 0;
            for (; r0 + PRODUCT_ROWS <= 16; r0 += PRODUCT_ROWS)
                for (int t = 0; t < DIM; t += 16)
                    weigh_rows(context + r0 * DIM + t, rescale + r0, weights + r0 * KEY_BLOCK, v + k0 * DIM + t,
                               count_keys, PRODUCT_ROWS);
            if (16 % PRODUCT_ROWS)
                for (int t = 0; t < DIM; t += 16)
                    weigh_rows(context + r0 * DIM + t, rescale + r0, weights + r0 * KEY_BLOCK, v + k0 * DIM + t,
                               count_keys, 16 % PRODUCT_ROWS);
        }
    }
    finish_group(&group, x, sequence, head, 0);
}

#endif

/* Whether attend() can run here: built with AMX and AVX512-BF16, and the kernel let this process use the AMX tile
   data (Linux asks each process to request it; PyTorch's oneDNN may have already). */
ENTRY int attend_available(void) {
#ifdef HAVE_AMX
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
#else
    return 0;
#endif
}

#ifdef HAVE_VECTORS
/* Items [begin, end) of attend()'s planes x chunks (an item: a plane, or a part of its rows) on the calling thread,
   in `workspace` (workspace_bytes(keys, width) of its own); bfloat16 needs the AMX tiles configured. */
static void attend_items(const AttendArgs *x, const int bf16, int64_t chunks, int64_t begin, int64_t end,
                         char *workspace) {
    const int64_t blocks = (x->length + QUERY_ROWS - 1) / QUERY_ROWS, per_chunk = (blocks + chunks - 1) / chunks;
    const int64_t padded = padded_keys(x->keys);
    /* the workspace: keys and values packed, U, its edges, T */
    float *t = (float *)(workspace + packed_bytes(padded) + (padded * x->width + 16) * 4 + padded * 2 * 4);
    /* the item (a plane, or a part of one) in the workspace: a part's U is made only where its rows read it, so
       that parts of one plane on many threads do not each make all of it, and a thread's next part packs again */
    int64_t packed = -1;
    Terms s;
    for (int64_t item = begin; item < end; item++) {
        const int64_t plane = item / chunks, sequence = plane / x->heads, head = plane % x->heads;
        const int64_t first = (item % chunks) * per_chunk, last = first + per_chunk < blocks ? first + per_chunk : blocks;
        if (first >= last) continue; /* a part past the last block */
        const int64_t row_first = first * QUERY_ROWS, row_last = last < blocks ? last * QUERY_ROWS : x->length;
        if (item != packed) {
            s = (Terms){
                .t = x->pos_key ? (const char *)t : NULL,
                .u = x->pos_query ? workspace + packed_bytes(padded) : NULL,
                .t_row = x->width,
                .u_row = x->width,
                .forward = x->column,
                .c2p_column = x->c2p_column,
                .length = x->length,
                .first_key = x->first_key,
            };
#ifdef HAVE_AMX
            if (bf16) pack_plane(x, sequence, head, row_first, row_last, workspace, &s);
            else
#endif
                pack_plane_f32(x, sequence, head, row_first, row_last, workspace, &s);
            packed = item;
        }
        for (int64_t block = first; block < last; block += ROW_GROUP) {
            const int64_t count = last - block < ROW_GROUP ? last - block : ROW_GROUP;
#ifdef HAVE_AMX
            if (bf16) attend_rows(x, sequence, head, block * QUERY_ROWS, count, workspace, &s, t);
            else
#endif
                attend_rows_f32(x, sequence, head, block * QUERY_ROWS, count, workspace, &s, t);
        }
    }
#ifndef HAVE_AMX
    (void)bf16;
#endif
}
#endif

/* Whether attend() and attend_part() can run these arguments: 0 if so, 1 where not (bfloat16 without an AMX build,
   float32 without a vector set, or neither table), COLUMNS_REFUSED where the contract's rules 1 and 2 do not hold
   (W a multiple of 16 besides, the tables' tiles). */
static int attend_refused(const AttendArgs *x, int64_t element_size) {
#ifdef HAVE_VECTORS
#ifndef HAVE_AMX
    if (element_size == 2) return 1;
#endif
    if ((element_size != 2 && element_size != 4) || (x->pos_key == NULL && x->pos_query == NULL)) return 1;
    if (x->heads < 1 || x->width % 16 ||
        columns_refused(x->column, x->c2p_column, x->length, x->width, 0, x->length, x->first_key, x->keys))
        return COLUMNS_REFUSED;
    return 0;
#else
    (void)x, (void)element_size;
    return 1;
#endif
}

/* Every plane on `threads` OpenMP threads, each plane's rows in `chunks` parts (more than one where there are fewer
   planes than threads); element_size 2 (bfloat16, on AMX) or 4 (float32). Each thread takes a contiguous share of
   the items (as OpenMP's static schedule would), in its own part of x->workspace. Returns 1 where it cannot run
   (attend_refused). */
ENTRY int attend(const AttendArgs *x, int64_t element_size, int64_t planes, int64_t chunks, int threads) {
    const int refused = attend_refused(x, element_size);
    if (refused) return refused;
#ifdef HAVE_VECTORS
    const int bf16 = element_size == 2;
    const int64_t bytes = workspace_bytes(x->keys, x->width), items = planes * chunks;
#pragma omp parallel num_threads(threads)
    {
#ifdef HAVE_AMX
        if (bf16) configure_tiles();
#endif
        const int64_t thread = omp_get_thread_num(), team = omp_get_num_threads();
        attend_items(x, bf16, chunks, items * thread / team, items * (thread + 1) / team,
                     (char *)x->workspace + thread * bytes);
#ifdef HAVE_AMX
        if (bf16) _tile_release();
#endif
    }
#else
    (void)planes, (void)chunks, (void)threads;
#endif
    return 0;
}

/* Float32 only: items [begin, end) of attend()'s planes x chunks on the calling thread, in `workspace`
   (workspace_bytes(keys, width)), for a caller with threads of its own (ONNX Runtime's, ort_attention.c). Returns 1
   where attend() would. */
ENTRY int attend_part(const AttendArgs *x, int64_t chunks, int64_t begin, int64_t end, void *workspace) {
    const int refused = attend_refused(x, 4);
    if (refused) return refused;
#ifdef HAVE_VECTORS
    attend_items(x, 0, chunks, begin, end, (char *)workspace);
#else
    (void)chunks, (void)begin, (void)end, (void)workspace;
#endif
    return 0;
}

/* The vector set the kernels were built for: "avx512", "avx2", "neon", or "none" (then only the element-by-element
   code is here, and native.py does not use the library). */
ENTRY const char *instruction_set(void) {
#ifdef HAVE_VECTORS
    return VECTOR_SET;
#else
    return "none";
#endif
}
