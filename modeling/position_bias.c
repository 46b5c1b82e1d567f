/* The bias of one block of query rows from the c2p and p2c tables, in one pass (see native.py).

   For query row i = first_row + a and key j = first_key + b, with c = column[i - j + L - 1] the table column of
   the distance i - j (DeBERTa's bucket, shifted and clipped), and W the number of table columns:

       out[p, a, b] = c2p[p, a, W - 1 - c] + p2c[p, b, c]     (or the dtype's minimum where keep[b] is 0)

   c2p (T = q Kr^T, Kr's rows in reverse order) holds the block's rows, p2c (U = k Qr^T) the block's keys; p runs
   over (sequence, head) planes. T's columns are reversed so that along a row of the bias (j ascending, i - j
   descending) both terms read their columns in ascending order: c2p_column[m] = W - 1 - column[2L - 2 - m] at
   m = L - 1 - i + j. Each sum is taken in float32 and rounded once to the output's type, as torch's add does.

   Compiled once on first use by native.py (cc -O3 -fopenmp and the instruction set's flags), and without OpenMP into
   ONNX Runtime's operator library (ort_attention.c; the pragmas are then ignored). Whole 16 x 16 tiles
   run with vectors of 16 float32 lanes, the rest one element at a time. The kernels are written once over a small
   vector layer, one header of inline functions per instruction set, chosen by the compiler's predefined macros:
   AVX-512 (position_bias_avx512.h), AVX2 + FMA (position_bias_avx2.h) and aarch64's NEON (position_bias_neon.h);
   position_bias_avx512.h says what each function does. Built for none of them, instruction_set() says "none" and
   native.py does not use the library. In a tile, the 16 columns that 16 consecutive distances read lie within 16
   consecutive table columns (one distance more reads the same column or the next: the contract below), so each
   term is one load of 16 columns, permuted where the
   columns are not 16 distinct ones (the log buckets) -- no gathers, which are slow on Xeons with the GDS
   mitigation. c2p is read along the tile's rows; p2c along its columns (one key's 16 rows) and transposed in
   registers. A tile whose every distance reads the table's first or last column (beyond the buckets' reach) is a
   row constant plus a key bias. The planes are shared between OpenMP threads of the runtime PyTorch already
   loaded (libgomp.so.1 is found by its name), so that the kernel and PyTorch's operators never compete for
   cores.

   Below position_bias(), hankel_bias() and hankel_bias_backward() make CPU training's bias, with the keys in reverse
   order, and sum its gradient into the tables; then attend() runs the whole attention with the tile code inside it
   (the bias never written): on the AMX tiles in bfloat16 (AVX-512 only), and with vector products in float32. */

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
/* The entries native.py loads by name. ort_attention.c's build for several sets makes them local to each set's unit
   (one library holds an AVX-512 and an AVX2 copy of this file, whose names must not collide). */
#ifndef ENTRY
#define ENTRY
#endif
/* AMX's macros: __AMX_TILE__ (gcc, newer clang) or __AMXTILE__ (clang before 16) */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && \
    (defined(__AMX_TILE__) || defined(__AMXTILE__)) && (defined(__AMX_BF16__) || defined(__AMXBF16__))
#define HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
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
    int64_t width;             /* W, the columns of a table row (c2p's and p2c's alike) */
} BiasArgs;

/* ---- What every entry below assumes of its arguments: the contract, checked by each entry before it reads ----

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
static int columns_refused(const int32_t *column, const int32_t *c2p_column, int64_t length, int64_t width,
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

/* One (sequence, head) plane of position_bias. */
static inline __attribute__((always_inline)) void bias_plane(const BiasArgs *args, int64_t sequence, int64_t head,
                                                            const int bf16, const int with_c2p, const int with_p2c) {
    const int64_t size = bf16 ? 2 : 4;
    Terms s = {
        .t = with_c2p ? (const char *)args->c2p + (sequence * args->c2p_plane + head * args->c2p_head) * size : NULL,
        .u = with_p2c ? (const char *)args->p2c + (sequence * args->p2c_plane + head * args->p2c_head) * size : NULL,
        .t_row = args->c2p_row,
        .u_row = args->p2c_row,
        .forward = args->column,
        .c2p_column = args->c2p_column,
        .length = args->length,
        .first_row = args->first_row,
        .first_key = args->first_key,
    };
    const uint8_t *keep = args->keep ? args->keep + sequence * args->keep_plane : NULL;
    char *out = (char *)args->out + (sequence * args->heads + head) * args->rows * args->keys * size;
    const int64_t rows = args->rows, keys = args->keys;
    int64_t tiled_rows = 0, tiled_keys = 0;
#ifdef HAVE_VECTORS
    tiled_rows = rows / 16 * 16;
    tiled_keys = keys / 16 * 16;
    float *edges = with_p2c ? malloc(sizeof(float) * 2 * (tiled_keys + 1)) : NULL;
    if (with_p2c && edges == NULL) tiled_rows = tiled_keys = 0; /* out of memory: element by element */
    if (edges) fill_edges(&s, edges, tiled_keys, bf16);
    for (int64_t a0 = 0; a0 < tiled_rows; a0 += 16) {
        for (int64_t b0 = 0; b0 < tiled_keys; b0 += 16) {
            const mask16 masked = keep ? m_zero_bytes(keep + b0) : 0;
            f32x16 m[16];
            bias_tile(&s, a0, b0, m, bf16, with_c2p, with_p2c);
            for (int r = 0; r < 16; r++) store16(out, (a0 + r) * keys + b0, m[r], masked, bf16);
        }
    }
    free(edges);
#endif
    for (int64_t a = 0; a < rows; a++) { /* what the tiles left: the last rows, and the last keys of every row */
        for (int64_t b = a < tiled_rows ? tiled_keys : 0; b < keys; b++) {
            const float sum = bias_at(&s, a, b, bf16);
            const int dropped = keep && !keep[b];
            if (bf16)
                ((uint16_t *)out)[a * keys + b] = dropped ? LOWEST_BF16 : to_bf16(sum);
            else
                ((float *)out)[a * keys + b] = dropped ? LOWEST_F32 : sum;
        }
    }
}

/* Every (sequence, head) plane, on `threads` OpenMP threads; element_size 2 (bfloat16) or 4 (float32). Returns 1
   for any other size or with neither table, COLUMNS_REFUSED where the contract's rules 1 and 2 do not hold. */
ENTRY int position_bias(const BiasArgs *args, int64_t element_size, int64_t planes, int threads) {
    const int c2p = args->c2p != NULL, p2c = args->p2c != NULL;
    if ((element_size != 2 && element_size != 4) || !(c2p || p2c)) return 1;
    if (args->heads < 1 || columns_refused(args->column, args->c2p_column, args->length, args->width, args->first_row,
                                           args->rows, args->first_key, args->keys))
        return COLUMNS_REFUSED;
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

/* ---- CPU training (sdpa_attention.BlockedAttention): the keys in reverse order ----

   With key j' = L - 1 - j, the distance i - j is i + j' - (L - 1), so in a block whose rows start at i0 the table
   column of row a and key b is column[i0 + a + b] (a Hankel matrix; `column` below starts at i0):

       out[p, a, b]  = T[p, a, column[a + b]] + U[p, b, column[a + b]]       (hankel_bias)
       dT[p, a, c]   = sum over the b with column[a + b] = c of dS[p, a, b]    (hankel_bias_backward, written)
       dU[p, b, c]  += sum over the a with column[a + b] = c of dS[p, a, b]    (added: a group's blocks share U)

   T is c2p of the block's rows (q Kr^T), U p2c of the reversed keys (k Qr^T); either may be NULL. Sums in float32,
   rounded once to bfloat16 where the tensors are bfloat16: the gradients are summed 16 table rows at a time in a
   float32 band, which is then written to (or added to) the table.

   `tiled` (one distance more reads the same column or the next, as position_bias's tiles need; the contract's rule
   1): whole 16 x 16 tiles run with vectors. In a tile the 16 columns of row a0 + r (keys b0 ..) and of
   key b0 + r (rows a0 ..) are both column[a0 + b0 + r ..], so each row of T and each row of U is read with one
   load of those columns, permuted (U's along the tile's columns, transposed in registers); the backward transposes
   dS's tiles the same way for dU and adds each row's 16 values into its 16 columns of the band, summing those that
   share a column first.
   Loads and stores stop at the last column read, which may be a table row's last (`to_last`). Otherwise, and at
   the edges, one element at a time; there any column vector works.

   Banded tables (`band_lines` > 0): a tile of 16 rows reads only the columns of its 16 + L - 1 distances (143 of
   T's 255 at 128 tokens), so T and U may hold just a band of each line's columns. Lines then come in tiles of
   `band_lines` (a multiple of 16, so that no tile of 16 lines straddles two), each tile `t_tile` (`u_tile`) elements
   after the last, and column 0 of tile k's lines stands for table column t_first[k] (u_first[k]): the element of
   line l at table column c is at line_start(l) + c - first[tile of l]. */

typedef struct {
    void *scores;                       /* out, or dS: [sequences, heads, rows, keys], contiguous */
    void *t;                            /* T (or dT) of plane 0; NULL without c2p */
    int64_t t_sequence, t_head, t_row;  /* element strides */
    void *u;                            /* U (or dU); NULL without p2c */
    int64_t u_sequence, u_head, u_row;
    const int32_t *column;              /* [rows + keys - 1]: the table column of row a and key b at a + b */
    int64_t heads, rows, keys, width;
    int64_t tiled;                      /* whole tiles with vectors (see above) */
    int64_t add_u;                      /* hankel_bias_backward: add to dU (else write it, zero where unread) */
    int64_t band_lines;                 /* 0: whole rows of `width` columns; else banded (see above), `width` each */
    int64_t t_tile, u_tile;             /* element strides between tiles of lines (banded) */
    const int32_t *t_first, *u_first;   /* per tile of lines, the table column of its column 0 (banded) */
} HankelArgs;

/* Where line `line` of a table starts (its first element), with `row` and `tile` strides (see above). */
static inline int64_t line_start(int64_t line, int64_t row, int64_t tile, int64_t band_lines) {
    if (!band_lines) return line * row;
    return line / band_lines * tile + line % band_lines * row;
}

/* The table column that element 0 of line `line` stands for: 0, or its tile's first column when banded. */
static inline int64_t line_first(const int32_t *first, int64_t line, int64_t band_lines) {
    return band_lines ? first[line / band_lines] : 0;
}

/* line_start less line_first: the element of the line at table column c is at this + c. */
static inline int64_t t_line(const HankelArgs *x, int64_t a) {
    return line_start(a, x->t_row, x->t_tile, x->band_lines) - line_first(x->t_first, a, x->band_lines);
}

static inline int64_t u_line(const HankelArgs *x, int64_t b) {
    return line_start(b, x->u_row, x->u_tile, x->band_lines) - line_first(x->u_first, b, x->band_lines);
}

static inline void put(void *table, int64_t index, float value, const int bf16) {
    if (bf16)
        ((uint16_t *)table)[index] = to_bf16(value);
    else
        ((float *)table)[index] = value;
}

#ifdef HAVE_VECTORS
/* band[row + columns[t]] += values[t] for t = 0 .. 15 (ascending columns, within 16 of the first), in float32:
   values that share a column are summed first, then one masked add over the columns' span. */
static inline void add16(float *band, int64_t row, const int32_t *columns, f32x16 values) {
    const int32_t lowest = columns[0];
    const int span = columns[15] - lowest + 1;
    if (span != 16) { /* some share a column: sum them into their column's lane */
        float in[16], sums[16] = {0};
        v_store(in, values);
        for (int t = 0; t < 16; t++) sums[columns[t] - lowest] += in[t];
        values = v_load(sums);
    }
    v_add_into_first(band + row + lowest, values, span);
}
#endif

static inline __attribute__((always_inline)) void hankel_plane(const HankelArgs *x, int64_t plane, const int bf16,
                                                              const int with_t, const int with_u) {
    const int64_t size = bf16 ? 2 : 4, sequence = plane / x->heads, head = plane % x->heads;
    const char *t = with_t ? (const char *)x->t + (sequence * x->t_sequence + head * x->t_head) * size : NULL;
    const char *u = with_u ? (const char *)x->u + (sequence * x->u_sequence + head * x->u_head) * size : NULL;
    char *out = (char *)x->scores + plane * x->rows * x->keys * size;
    int64_t tiled_rows = 0, tiled_keys = 0;
#ifdef HAVE_VECTORS
    if (x->tiled) {
        tiled_rows = x->rows / 16 * 16;
        tiled_keys = x->keys / 16 * 16;
    }
    for (int64_t a0 = 0; a0 < tiled_rows; a0 += 16) {
        for (int64_t b0 = 0; b0 < tiled_keys; b0 += 16) {
            const int32_t *column = x->column + a0 + b0;
            f32x16 m[16];
            if (with_u) { /* key b0 + r over rows a0 .. a0 + 15 */
                for (int r = 0; r < 16; r++) m[r] = columns16(u, u_line(x, b0 + r), column + r, bf16, 1);
                v_transpose16(m);
            }
            for (int r = 0; r < 16; r++) { /* row a0 + r over keys b0 .. b0 + 15 */
                if (with_t) {
                    const f32x16 c2p = columns16(t, t_line(x, a0 + r), column + r, bf16, 1);
                    m[r] = with_u ? v_add(c2p, m[r]) : c2p;
                }
                store16(out, (a0 + r) * x->keys + b0, m[r], 0, bf16);
            }
        }
    }
#endif
    for (int64_t a = 0; a < x->rows; a++) { /* what the tiles left */
        const int32_t *column = x->column + a;
        for (int64_t b = a < tiled_rows ? tiled_keys : 0; b < x->keys; b++) {
            float sum = 0.0f;
            if (with_t) sum = element(t, t_line(x, a) + column[b], bf16);
            if (with_u) sum += element(u, u_line(x, b) + column[b], bf16);
            put(out, a * x->keys + b, sum, bf16);
        }
    }
}

/* Whether every tile of `lines` lines of a banded table reads within its band: line l reads column[l + s] for
   s = 0 .. along - 1, and the column ascends, so a tile's lowest column is its first line's at s = 0 and its
   highest its last line's at along - 1. */
static int band_holds(const HankelArgs *x, const int32_t *first, int64_t lines, int64_t along) {
    for (int64_t k = 0; k * x->band_lines < lines; k++) {
        const int64_t line = k * x->band_lines, last = line + x->band_lines < lines ? line + x->band_lines : lines;
        if (x->column[line] < first[k] || x->column[last - 1 + along - 1] >= first[k] + x->width) return 0;
    }
    return 1;
}

/* 0 if the arguments keep the contract (rules 1 and 2 over the rows + keys - 1 columns read; banded tables hold their
   own columns, so the range is the band's, checked by band_holds) and the tables' layout is one the kernels take:
   unbanded, or banded with every read inside the bands. */
static int hankel_refused(const HankelArgs *x) {
    int64_t at;
    if (x->heads < 1 || x->rows < 0 || x->keys < 0 || x->width < 1 ||
        column_fault(x->column, x->rows + x->keys - 1, x->band_lines ? INT32_MAX : x->width, x->tiled, &at))
        return COLUMNS_REFUSED;
    if (!x->band_lines) return 0;
    if (x->band_lines < 0 || x->band_lines % 16) return 3;
    if (x->t && !band_holds(x, x->t_first, x->rows, x->keys)) return 3;
    if (x->u && !band_holds(x, x->u_first, x->keys, x->rows)) return 3;
    return 0;
}

/* out = T + U along the Hankel columns, every plane on `threads` OpenMP threads; element_size 2 (bfloat16) or 4
   (float32). Returns 1 for any other size or with neither table, 3 for bands that do not hold what is read,
   COLUMNS_REFUSED where the contract does not hold. */
ENTRY int hankel_bias(const HankelArgs *x, int64_t element_size, int64_t planes, int threads) {
    const int t = x->t != NULL, u = x->u != NULL;
    if ((element_size != 2 && element_size != 4) || !(t || u)) return 1;
    const int refused = hankel_refused(x);
    if (refused) return refused;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t plane = 0; plane < planes; plane++) {
        if (element_size == 2 && t && u) hankel_plane(x, plane, 1, 1, 1);
        else if (element_size == 2 && t) hankel_plane(x, plane, 1, 1, 0);
        else if (element_size == 2) hankel_plane(x, plane, 1, 0, 1);
        else if (t && u) hankel_plane(x, plane, 0, 1, 1);
        else if (t) hankel_plane(x, plane, 0, 1, 0);
        else hankel_plane(x, plane, 0, 0, 1);
    }
    return 0;
}

/* A band's 16 float32 rows into the table's lines first .. first + count - 1 (each line_start(line, row, tile,
   band_lines) elements in): written, or added to, rounded once. */
static void flush_band(const float *band, int64_t width, char *table, int64_t row, int64_t tile, int64_t band_lines,
                       int64_t first, int64_t count, const int add, const int bf16) {
    for (int64_t r = 0; r < count; r++) {
        char *line = table + line_start(first + r, row, tile, band_lines) * (bf16 ? 2 : 4);
        for (int64_t c = 0; c < width; c++)
            put(line, c, band[r * width + c] + (add ? element(line, c, bf16) : 0.0f), bf16);
    }
}

/* dS summed into `count` lines of a table (lines first .. of dT, or, `keys`, of dU) in the float32 `band` ([16, W],
   column c of a line at c - shift: its tile's first column when banded): line l of the band reads dS along the other
   axis, s = 0 .. along - 1, at column[first + l + s]; whole tiles up to `tiled` along it (dU's transposed in
   registers), then element by element. */
static inline __attribute__((always_inline)) void sum_lines(const HankelArgs *x, const char *grad, float *band,
                                                           int64_t first, int64_t count, int64_t along, int64_t tiled,
                                                           int64_t shift, const int keys, const int bf16) {
    const int64_t W = x->width, line_stride = keys ? 1 : x->keys, along_stride = keys ? x->keys : 1;
    memset(band, 0, 16 * W * sizeof(float));
#ifdef HAVE_VECTORS
    for (int64_t s0 = 0; s0 < tiled; s0 += 16) {
        f32x16 m[16];
        for (int r = 0; r < 16; r++) /* dS's row r of the tile: line r (dT) or position s0 + r along (dU) */
            m[r] = keys ? load16(grad, (s0 + r) * x->keys + first, bf16) : load16(grad, (first + r) * x->keys + s0, bf16);
        if (keys) v_transpose16(m);
        for (int r = 0; r < 16; r++) add16(band, r * W - shift, x->column + first + s0 + r, m[r]);
    }
#else
    tiled = 0;
#endif
    for (int64_t l = 0; l < count; l++)
        for (int64_t s = tiled; s < along; s++)
            band[l * W + x->column[first + l + s] - shift] +=
                element(grad, (first + l) * line_stride + s * along_stride, bf16);
}

/* One plane's gradients, a band of 16 table lines at a time, summed in float32 and rounded once: dT's rows (a sweep
   over the keys), then dU's rows (a sweep over the rows). */
static inline __attribute__((always_inline)) void hankel_plane_backward(const HankelArgs *x, int64_t plane,
                                                                       float *band, const int bf16) {
    const int64_t size = bf16 ? 2 : 4, sequence = plane / x->heads, head = plane % x->heads;
    char *t = x->t ? (char *)x->t + (sequence * x->t_sequence + head * x->t_head) * size : NULL;
    char *u = x->u ? (char *)x->u + (sequence * x->u_sequence + head * x->u_head) * size : NULL;
    const char *grad = (const char *)x->scores + plane * x->rows * x->keys * size;
    const int64_t rows = x->rows, keys = x->keys, lines = x->band_lines;
    const int64_t tiled_rows = x->tiled ? rows / 16 * 16 : 0, tiled_keys = x->tiled ? keys / 16 * 16 : 0;
    for (int64_t a0 = 0; t && a0 < rows; a0 += 16) { /* dT[a, column[a + b]] += dS[a, b] */
        const int64_t count = rows - a0 < 16 ? rows - a0 : 16;
        sum_lines(x, grad, band, a0, count, keys, a0 < tiled_rows ? tiled_keys : 0, line_first(x->t_first, a0, lines),
                  0, bf16);
        flush_band(band, x->width, t, x->t_row, x->t_tile, lines, a0, count, 0, bf16);
    }
    for (int64_t b0 = 0; u && b0 < keys; b0 += 16) { /* dU[b, column[a + b]] += dS[a, b] */
        const int64_t count = keys - b0 < 16 ? keys - b0 : 16;
        sum_lines(x, grad, band, b0, count, rows, b0 < tiled_keys ? tiled_rows : 0, line_first(x->u_first, b0, lines),
                  1, bf16);
        flush_band(band, x->width, u, x->u_row, x->u_tile, lines, b0, count, (int)x->add_u, bf16);
    }
}

/* dT (written) and dU (added, or written with add_u 0) from dS, every plane on `threads` OpenMP threads. Returns 1
   for an element size other than 2 or 4, or with neither table; 2 where a thread's band could not be allocated; 3 as
   hankel_bias does. */
ENTRY int hankel_bias_backward(const HankelArgs *x, int64_t element_size, int64_t planes, int threads) {
    if ((element_size != 2 && element_size != 4) || !(x->t || x->u)) return 1;
    const int refused = hankel_refused(x);
    if (refused) return refused;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *band = malloc(16 * x->width * sizeof(float));
        failed = band == NULL;
#pragma omp for schedule(static)
        for (int64_t plane = 0; plane < planes; plane++) {
            if (band == NULL) continue;
            if (element_size == 2) hankel_plane_backward(x, plane, band, 1);
            else hankel_plane_backward(x, plane, band, 0);
        }
        free(band);
    }
    return failed ? 2 : 0;
}

/* ---- Attention with the position terms made inside the tile (bfloat16 on AMX; float32 below) ----

   attend() computes, for each (sequence, head) plane and query row i, over the keys j of [first_key, first_key + keys):

       out_i = sum_j softmax_j(scale q_i . k_j + c2p[i, j] + p2c[i, j]) v_j      (keys whose keep is 0 left out)

   with c2p[i, j] = q_i . Kr[c(i - j)] and p2c[i, j] = k_j . Qr[c(i - j)] (Kr and Qr scaled already), the bias never
   written to memory. Each thread takes one plane at a time and makes its tables in float32 on the AMX tiles: U =
   k Qr^T for the plane's keys, then, for each block of 16 query rows, T = q Kr^T of those rows, so that both stay in
   cache; position_bias()'s tile code then reads them exactly as it reads its own. Flash attention's order: for each
   block of 16 query rows, blocks of KEY_BLOCK keys in turn, with a running maximum and sum per row (the online
   softmax). The products q k^T and p v run on the AMX tiles in bfloat16 with float32 sums; the scores, the softmax
   and the context stay in float32 until the context is rounded once to bfloat16. A row whose every key is left out
   comes out 0 (the caller handles a sequence of padding).

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
        /* 0, not a subnormal, where the maximum rose by more than 87 (see exp16) */
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
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} TileConfig;

/* Into L2, the lines of U (p2c, float32) that the next block of rows (16 from row `next`) reads for keys b_first
   .. b_last - 1 inside the buckets' reach: each key's run of 16 columns is a line of its own row of U, read once
   per block and 2 KiB or more from the next key's, so that without this every one was a miss to the last-level
   cache. bfloat16 only: float32's products take long enough to hide them. */
static inline void prefetch_u(const Terms *s, int64_t next, int64_t b_first, int64_t b_last) {
    const int64_t L = s->length;
    if (!s->u || next >= L) return;
    for (int64_t b = b_first; b < b_last; b++) {
        int64_t low = next - (s->first_key + b) + L - 1, high = low + 15;
        high = high > 2 * L - 2 ? 2 * L - 2 : high;
        const int32_t from = s->forward[low], to = s->forward[high];
        if (beyond_reach(s, from, to)) continue; /* the tile reads the edges, not U */
        const float *row = (const float *)s->u + b * s->u_row;
        _mm_prefetch((const char *)(row + from), _MM_HINT_T1);
        _mm_prefetch((const char *)(row + to), _MM_HINT_T1);
    }
}

/* out[16, W] at columns [first, last) = the 16 rows in tiles 4 and 5 against the relative rows packed as key tiles. */
static void table_rows(const uint32_t *packed, int64_t width, float *out, int64_t first, int64_t last) {
    for (int64_t c0 = first; c0 < last; c0 += 64) {
#define COLUMNS(n)                                                  \
    if (c0 + 16 * (n) < last) {                                     \
        _tile_zero(n);                                              \
        _tile_loadd(6, packed + ((c0 / 16 + (n)) * 2) * 256, 64);   \
        _tile_dpbf16ps(n, 4, 6);                                    \
        _tile_loadd(7, packed + ((c0 / 16 + (n)) * 2 + 1) * 256, 64); \
        _tile_dpbf16ps(n, 5, 7);                                    \
        _tile_stored(n, out + c0 + 16 * (n), width * 4);            \
    }
        COLUMNS(0) COLUMNS(1) COLUMNS(2) COLUMNS(3)
#undef COLUMNS
    }
}

/* 16 rows of 64 bfloat16 from `rows` (row stride in elements) into `into`, zeros past `count` rows. */
static void copy_rows(const uint16_t *rows, int64_t stride, int64_t count, uint16_t *into) {
    for (int r = 0; r < 16; r++)
        for (int h = 0; h < 2; h++)
            _mm512_storeu_si512(into + r * DIM + 32 * h, r < count ? _mm512_loadu_si512(rows + r * stride + 32 * h)
                                                                   : _mm512_setzero_si512());
}

/* One plane's keys and values in the tiles' layout, from key first_key on, zeros past the last; U for its keys at
   the columns that rows [row_first, row_last) read, and U's edge columns. */
static void pack_plane(const AttendArgs *x, int64_t sequence, int64_t head, int64_t row_first, int64_t row_last,
                       char *workspace, Terms *s) {
    const int64_t keys = x->keys, padded = padded_keys(keys), width = x->width;
    uint32_t *key_tiles = (uint32_t *)workspace;          /* [padded / 16][2][16][16] */
    uint32_t *value_tiles = key_tiles + padded * DIM / 2; /* [padded / 32][4][16][16] */
    float *u = (float *)(workspace + packed_bytes(padded));
    const uint16_t *k = x->key + sequence * x->key_sequence + head * x->key_head + x->first_key * x->key_row;
    const uint16_t *v = x->value + sequence * x->value_sequence + head * x->value_head + x->first_key * x->value_row;
    __attribute__((aligned(64))) uint16_t rows[QUERY_ROWS * DIM];
    for (int64_t j0 = 0; j0 < padded; j0 += 16) {
        for (int h = 0; h < 2; h++) { /* dimensions 32h .. 32h + 31: row n = key j0 + n, as 16 pairs */
            __m512 m[16];
            for (int n = 0; n < 16; n++)
                m[n] = j0 + n < keys ? _mm512_loadu_ps((const float *)(k + (j0 + n) * x->key_row + 32 * h)) : _mm512_setzero_ps();
            v_transpose16(m);
            for (int r = 0; r < 16; r++) _mm512_storeu_ps((float *)(key_tiles + ((j0 / 16) * 2 + h) * 256 + r * 16), m[r]);
        }
        if (x->pos_query && j0 < keys) { /* U of these 16 keys */
            copy_rows(k + j0 * x->key_row, x->key_row, keys - j0, rows);
            _tile_loadd(4, rows, DIM * 2);
            _tile_loadd(5, rows + 32, DIM * 2);
            int64_t first, last;
            u_columns(x, j0, row_first, row_last, &first, &last);
            table_rows(x->pos_query + head * (width / 16) * 2 * 256, width, u + j0 * width, first, last);
        }
    }
    /* lanes 2n and 2n + 1 of a value tile row: element n (of the tile's 16 dimensions) of keys 2r and 2r + 1 */
    __attribute__((aligned(64))) int16_t index[32];
    for (int n = 0; n < 16; n++) index[2 * n] = (int16_t)n, index[2 * n + 1] = (int16_t)(32 + n);
    const __m512i low = _mm512_load_si512(index), high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
    for (int64_t j = 0; j < padded; j += 2) {
        uint32_t *row = value_tiles + (j / 32) * 4 * 256 + ((j % 32) / 2) * 16;
        for (int half = 0; half < 2; half++) { /* dimensions 32 half .. 32 half + 31: tiles 2 half, 2 half + 1 */
            const __m512i a = j < keys ? _mm512_loadu_si512(v + j * x->value_row + 32 * half) : _mm512_setzero_si512();
            const __m512i b = j + 1 < keys ? _mm512_loadu_si512(v + (j + 1) * x->value_row + 32 * half) : _mm512_setzero_si512();
            _mm512_storeu_si512(row + (2 * half) * 256, _mm512_permutex2var_epi16(a, low, b));
            _mm512_storeu_si512(row + (2 * half + 1) * 256, _mm512_permutex2var_epi16(a, high, b));
        }
    }
    if (x->pos_query) fill_edges(s, u + padded * width + 16, keys / 16 * 16, 0);
}

/* Rows [a0, a0 + 16 count) of one plane (fewer at the end), count <= ROW_GROUP blocks of 16 in one sweep over the
   keys and values packed in `workspace` (a Group: in bfloat16, whose keys and values take half the room, it timed
   within a few percent of one block per sweep); `tables` holds each block's T ([16, W], one after another). While a
   block's weights are made, the lines of U the next block reads are fetched. */
static void attend_rows(const AttendArgs *x, int64_t sequence, int64_t head, int64_t a0, int64_t count, char *workspace,
                        Terms *s, float *tables) {
    const int64_t keys = x->keys, padded = padded_keys(keys), width = x->width;
    const uint32_t *key_tiles = (const uint32_t *)workspace, *value_tiles = key_tiles + padded * DIM / 2;
    const uint8_t *keep = x->keep ? x->keep + sequence * x->keep_sequence : NULL;
    __attribute__((aligned(64))) uint16_t query[ROW_GROUP][QUERY_ROWS * DIM], weights[QUERY_ROWS * KEY_BLOCK];
    __attribute__((aligned(64))) float scores[QUERY_ROWS * KEY_BLOCK], block[QUERY_ROWS * DIM];
    Group group;
    start_group(&group, a0, count, x->length);
    for (int64_t g = 0; g < count; g++) {
        copy_rows(x->query + sequence * x->query_sequence + head * x->query_head + (a0 + g * QUERY_ROWS) * x->query_row,
                  x->query_row, group.rows[g], query[g]);
        if (x->pos_key) { /* T of the rows */
            int64_t first, last;
            t_columns(x, a0 + g * QUERY_ROWS, &first, &last);
            _tile_loadd(4, query[g], DIM * 2);
            _tile_loadd(5, query[g] + 32, DIM * 2);
            table_rows(x->pos_key + head * (width / 16) * 2 * 256, width, tables + g * QUERY_ROWS * width, first, last);
        }
    }
    for (int64_t k0 = 0; k0 < keys; k0 += KEY_BLOCK) {
        for (int64_t g = 0; g < count; g++) {
            /* scores = q k^T of the block, 64 keys at a time: tile n holds keys 16n .. 16n + 15 of the 64 */
            _tile_loadd(4, query[g], DIM * 2);
            _tile_loadd(5, query[g] + 32, DIM * 2);
            for (int64_t part = k0; part < k0 + KEY_BLOCK && part < keys; part += 64) {
                const uint32_t *kt = key_tiles + (part / 16) * 2 * 256;
                float *into = scores + (part - k0);
#define SCORES(n)                                 \
    _tile_zero(n);                                \
    _tile_loadd(6, kt + (2 * (n)) * 256, 64);     \
    _tile_dpbf16ps(n, 4, 6);                      \
    _tile_loadd(7, kt + (2 * (n) + 1) * 256, 64); \
    _tile_dpbf16ps(n, 5, 7);                      \
    _tile_stored(n, into + 16 * (n), KEY_BLOCK * 4);
                SCORES(0) SCORES(1) SCORES(2) SCORES(3)
#undef SCORES
            }
            float rescale[QUERY_ROWS];
            softmax_block(&group, g, x, s, tables, k0, keep, scores, rescale, weights, 1);
            if (g + 1 < count) prefetch_u(s, a0 + (g + 1) * QUERY_ROWS, k0, k0 + KEY_BLOCK < keys ? k0 + KEY_BLOCK : keys);
            else prefetch_u(s, a0, k0 + KEY_BLOCK, k0 + 2 * KEY_BLOCK < keys ? k0 + 2 * KEY_BLOCK : keys);
            /* block = weights v: tile n holds dimensions 16n .. 16n + 15, over the block's keys 32 at a time */
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t part = k0; part < k0 + KEY_BLOCK && part < keys; part += 32) {
                const uint32_t *vt = value_tiles + (part / 32) * 4 * 256;
                _tile_loadd(4, weights + (part - k0), KEY_BLOCK * 2);
                _tile_loadd(6, vt, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_loadd(7, vt + 256, 64);
                _tile_dpbf16ps(1, 4, 7);
                _tile_loadd(6, vt + 512, 64);
                _tile_dpbf16ps(2, 4, 6);
                _tile_loadd(7, vt + 768, 64);
                _tile_dpbf16ps(3, 4, 7);
            }
            _tile_stored(0, block, DIM * 4);
            _tile_stored(1, block + 16, DIM * 4);
            _tile_stored(2, block + 32, DIM * 4);
            _tile_stored(3, block + 48, DIM * 4);
            float *context = group.context[g]; /* context * rescale + block */
            for (int r = 0; r < QUERY_ROWS; r++) {
                const __m512 factor = _mm512_set1_ps(rescale[r]);
                for (int c = 0; c < DIM; c += 16) {
                    const __m512 sum = _mm512_fmadd_ps(_mm512_loadu_ps(context + r * DIM + c), factor,
                                                       _mm512_loadu_ps(block + r * DIM + c));
                    _mm512_storeu_ps(context + r * DIM + c, sum);
                }
            }
        }
    }
    finish_group(&group, x, sequence, head, 1);
}
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
        if (bf16) {
            TileConfig config = {.palette = 1};
            for (int t = 0; t < 8; t++) {
                config.bytes_per_row[t] = 64;
                config.rows[t] = 16;
            }
            _tile_loadconfig(&config);
        }
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

/* ---- Dropout's decisions for CPU training (sdpa_attention.dropout_keep_mask) ----

   out[n] = 1 (keep) where the 15 bits 16 (n % 4) .. 16 (n % 4) + 14 of draw n / 4 are below `threshold`, else 0,
   for n in [0, count). Draw k is SplitMix64's output function of seed + (k + 1) * 0x9e3779b97f4a7c15 (the
   generator's k-th output from state `seed`), so that every draw depends on its index alone: the threads split the
   draws as they like and the mask is the same on any number of them. The seed comes from PyTorch's generator, one
   per mask, so that torch.manual_seed reproduces a mask and consecutive masks differ. */

static inline uint64_t splitmix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

typedef struct {
    uint8_t *out;       /* [count] */
    int64_t count;
    uint64_t seed;
    int64_t threshold;  /* keep where the 15 bits are below it: round((1 - p) 2^15) */
} KeepArgs;

/* The decisions of x->out on `threads` OpenMP threads; returns 1 for a threshold outside [0, 2^15]. */
ENTRY int keep_mask(const KeepArgs *x, int threads) {
    if (x->threshold < 0 || x->threshold > (1 << 15)) return 1;
    uint8_t *out = x->out;
    const int64_t draws = x->count / 4;
    const uint64_t below = (uint64_t)x->threshold, seed = x->seed;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t k = 0; k < draws; k++) {
        const uint64_t bits = splitmix64(seed + (uint64_t)(k + 1) * 0x9e3779b97f4a7c15ull);
        for (int lane = 0; lane < 4; lane++) out[4 * k + lane] = ((bits >> (16 * lane)) & 0x7fff) < below;
    }
    if (draws * 4 < x->count) { /* the last draw, in part */
        const uint64_t bits = splitmix64(seed + (uint64_t)(draws + 1) * 0x9e3779b97f4a7c15ull);
        for (int64_t n = draws * 4; n < x->count; n++) out[n] = ((bits >> (16 * (n % 4))) & 0x7fff) < below;
    }
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
