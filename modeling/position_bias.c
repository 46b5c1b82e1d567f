/* The PyTorch kernels' library (native.py loads its entries by name): position_bias.h's attention and contract, and
   here the bias of one block of query rows from the c2p and p2c tables in one pass (position_bias), CPU training's
   bias with the keys in reverse order and its gradient summed into the tables (hankel_bias, hankel_bias_backward),
   and dropout's decisions (keep_mask). The planes are shared between OpenMP threads of the runtime PyTorch already
   loaded (libgomp.so.1 is found by its name), so that the kernels and PyTorch's operators never compete for cores.

   position_bias: for query row i = first_row + a and key j = first_key + b, with c = column[i - j + L - 1] the table
   column of the distance i - j (DeBERTa's bucket, shifted and clipped), and W the number of table columns:

       out[p, a, b] = c2p[p, a, W - 1 - c] + p2c[p, b, c]     (or the dtype's minimum where keep[b] is 0)

   c2p (T = q Kr^T, Kr's rows in reverse order) holds the block's rows, p2c (U = k Qr^T) the block's keys; p runs
   over (sequence, head) planes. T's columns are reversed so that along a row of the bias (j ascending, i - j
   descending) both terms read their columns in ascending order: c2p_column[m] = W - 1 - column[2L - 2 - m] at
   m = L - 1 - i + j. Each sum is taken in float32 and rounded once to the output's type, as torch's add does. */

#include "position_bias.h"

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
