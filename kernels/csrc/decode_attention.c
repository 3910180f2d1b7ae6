/* Paged decode attention on the CPU, float32: one new token per sequence, its keys and values read
 * where they lie in the unified pool (no gather, no padding). The torch path (kernels/attention_torch.py)
 * is the reference; kernels/attention_cpu.py builds this file and calls it.
 *
 *   for each sequence g, KV head j, query head h of j's group (h = j * R + i, R = H / H_kv):
 *       s[t]  = q[g, h] . K[row(g, t), j] * scale              for keys t in [first[g], last[g])
 *       out[g, h] = sum_t softmax(s)[t] * V[row(g, S + t), j]
 *
 * rows: [G, 2 * S] pool rows, a sequence's K rows then its V rows (S slots each); pool rows hold
 * H_kv * D floats, `row_stride` apart. Each key and value row is read once, whole, for every head.
 * Scores go to `scratch` (H * S floats); one thread.
 */
#include <math.h>
#include <stdint.h>

void decode_attention_f32(const float *q, int64_t q_token_stride, int64_t q_head_stride, const float *pool,
                          int64_t row_stride, const int64_t *rows, int64_t slots, const int64_t *first,
                          const int64_t *last, int64_t seqs, int64_t heads, int64_t kv_heads, int64_t dim,
                          float scale, float *out, float *scratch) {
    const int64_t group = heads / kv_heads;
    for (int64_t g = 0; g < seqs; g++) {
        const int64_t *k_rows = rows + g * 2 * slots, *v_rows = k_rows + slots;
        const int64_t t0 = first[g], t1 = last[g];
        const float *qg = q + g * q_token_stride;
        float *og = out + g * heads * dim;
        for (int64_t t = t0; t < t1; t++) { /* each key row read once, whole, for every head */
            const float *k = pool + k_rows[t] * row_stride;
            for (int64_t h = 0; h < heads; h++) {
                const float *qh = qg + h * q_head_stride, *kh = k + (h / group) * dim;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < dim; d++) dot += qh[d] * kh[d];
                scratch[h * slots + t] = dot * scale;
            }
        }
        for (int64_t h = 0; h < heads; h++) {
            float *s = scratch + h * slots, top = s[t0], sum = 0.0f;
            for (int64_t t = t0 + 1; t < t1; t++) top = s[t] > top ? s[t] : top;
            for (int64_t t = t0; t < t1; t++) sum += (s[t] = expf(s[t] - top));
            for (int64_t t = t0; t < t1; t++) s[t] /= sum;
            for (int64_t d = 0; d < dim; d++) og[h * dim + d] = 0.0f;
        }
        for (int64_t t = t0; t < t1; t++) { /* each value row read once, whole */
            const float *v = pool + v_rows[t] * row_stride;
            for (int64_t h = 0; h < heads; h++) {
                const float p = scratch[h * slots + t], *vh = v + (h / group) * dim;
                float *o = og + h * dim;
#pragma omp simd
                for (int64_t d = 0; d < dim; d++) o[d] += p * vh[d];
            }
        }
    }
}
