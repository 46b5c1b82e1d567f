/* position_bias.h's attention in bfloat16 on AMX's tiles (attend_rows and what it needs), with AVX-512 around them.
   Included by position_bias.h where the compiler targets AMX and AVX512-BF16 (HAVE_AMX), after the code it builds
   on (the tile code, the Group and its softmax); the section "Attention with the position terms made inside the
   tile" there says how the tiles are used. */

#include <sys/syscall.h>
#include <unistd.h>

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} TileConfig;

/* This thread's tiles: 8 of 16 rows of 64 bytes (palette 1). */
static void configure_tiles(void) {
    TileConfig config = {.palette = 1};
    for (int t = 0; t < 8; t++) {
        config.bytes_per_row[t] = 64;
        config.rows[t] = 16;
    }
    _tile_loadconfig(&config);
}

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
