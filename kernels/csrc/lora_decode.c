/* LoRA of one bucket's tiles on the CPU, float32, reading the adapters' rows where they lie in the
 * unified pool (no gather, no intermediate copy). The torch path (kernels/lora_torch.py) is the reference;
 * kernels/lora_cpu.py builds this file and calls it for buckets of a few tokens per tile (decode).
 *
 *   for each tile i (one adapter) and each of its t tokens x = x[token]:
 *       v[q]  = (x . A_i[q]) * scale[i]                     q < vectors: the group's A rank vectors, stacked
 *       y_o[token] += sum_{q < rank} v[v_col[o] + q] * B_{i,o}[q]     for each output o (a module)
 *
 * An A vector is c_in pool rows (the first d_in floats of them), a B row c_out pool rows (d_out floats);
 * pool rows are W floats. Row of A chunk c of vector q of tile i: a_rows[(i * vectors + q) * c_in + c],
 * or a_start + that index when a_rows is NULL (rows read in place); B likewise from b_rows + b_start[o]
 * (or b_start[o] + index when b_rows is NULL). y_o is a column view: row `token` at y[o] + token * y_stride[o].
 * Each row is read once per tile, for all its tokens; v holds the tile's shrinks (t * vectors floats).
 *
 * The pool's rows hold float32, or an adapter's rows at half precision (bfloat16 or float16: two of its rows
 * in one float32 row, kernels/batch.py `rows_view`): lora_bucket_bf16 and lora_bucket_f16 take `pool` as
 * such rows of W values, widen each value to float32 as it is read and compute as lora_bucket_f32 does.
 */
#include <stdint.h>
#include <string.h>

static inline int64_t row_of(const int64_t *table, int64_t start, int64_t index) {
    return table ? table[start + index] : start + index;
}

static inline float from_f32(const float *p, int64_t d) { return p[d]; }
static inline float from_bf16(const uint16_t *p, int64_t d) { /* a bfloat16 is the top half of a float32 */
    const uint32_t bits = (uint32_t)p[d] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
static inline float from_f16(const _Float16 *p, int64_t d) { return (float)p[d]; }

#define LORA_BUCKET(NAME, T, LOAD)                                                                               \
    void NAME(const float *x, int64_t x_stride, const int64_t *tokens, int64_t tiles, int64_t t, const T *pool,  \
              int64_t w, const int64_t *a_rows, int64_t a_start, int64_t vectors, int64_t c_in, int64_t d_in,    \
              const float *scale, const int64_t *b_rows, int64_t outputs, const int64_t *b_start,                \
              const int64_t *v_col, const int64_t *c_out, const int64_t *d_out, float *const *y,                 \
              const int64_t *y_stride, int64_t rank, float *v) {                                                 \
        for (int64_t i = 0; i < tiles; i++) {                                                                    \
            const int64_t *tile = tokens + i * t;                                                                \
            for (int64_t k = 0; k < t * vectors; k++) v[k] = 0.0f; /* v[j * vectors + q]: token j's shrink */   \
            for (int64_t q = 0; q < vectors; q++) {                                                              \
                for (int64_t c = 0; c < c_in; c++) { /* each A row read once, for every token of the tile */     \
                    const T *a = pool + row_of(a_rows, a_start, (i * vectors + q) * c_in + c) * w;               \
                    const int64_t n = d_in - c * w < w ? d_in - c * w : w;                                       \
                    for (int64_t j = 0; j < t; j++) {                                                            \
                        const float *xc = x + tile[j] * x_stride + c * w;                                        \
                        float dot = 0.0f;                                                                        \
                        _Pragma("omp simd reduction(+ : dot)") for (int64_t d = 0; d < n; d++) dot +=            \
                            xc[d] * LOAD(a, d);                                                                  \
                        v[j * vectors + q] += dot;                                                               \
                    }                                                                                            \
                }                                                                                                \
            }                                                                                                    \
            for (int64_t k = 0; k < t * vectors; k++) v[k] *= scale[i];                                          \
            for (int64_t o = 0; o < outputs; o++) {                                                              \
                for (int64_t q = 0; q < rank; q++) {                                                             \
                    for (int64_t c = 0; c < c_out[o]; c++) { /* each B row read once, for every token */         \
                        const T *b = pool + row_of(b_rows, b_start[o], (i * rank + q) * c_out[o] + c) * w;       \
                        const int64_t n = d_out[o] - c * w < w ? d_out[o] - c * w : w;                           \
                        for (int64_t j = 0; j < t; j++) {                                                        \
                            const float p = v[j * vectors + v_col[o] + q];                                       \
                            float *yc = y[o] + tile[j] * y_stride[o] + c * w;                                    \
                            _Pragma("omp simd") for (int64_t d = 0; d < n; d++) yc[d] += p * LOAD(b, d);         \
                        }                                                                                        \
                    }                                                                                            \
                }                                                                                                \
            }                                                                                                    \
        }                                                                                                        \
    }

LORA_BUCKET(lora_bucket_f32, float, from_f32)
LORA_BUCKET(lora_bucket_bf16, uint16_t, from_bf16)
LORA_BUCKET(lora_bucket_f16, _Float16, from_f16)
