/* pdctl's CPU attention over paged KV (float32), one query row at a time.
 *
 * The torch path (attention.py) computes a query in tiles of 16 rows against blocks of
 * 64 keys, padding included: a decode step of one token per request does sixteen rows'
 * work and tens of small tensor operations per layer. Here each query row is computed
 * alone, over its own keys only, in one fixed order:
 *
 *   query i of piece p (position t = starts[p] + i - query_offsets[p]), query head h,
 *   KV head h / group; keys j = first(t) .. t, first(t) = max(0, t - window + 1)
 *   key j of piece p:  K/V row rows[key_offsets[p] + j], columns [kv_head * dim, +dim)
 *
 *   s_j  = dot(q, k_j) * scale   (8 partial sums over the dims, added in one order)
 *   peak = max_j s_j             (exact in any order)
 *   w_j  = e^(s_j - peak)       (exp_nonpositive: the same on every host)
 *   out  = (sum_j w_j * v_j) / (sum_j w_j)   (both sums over j ascending)
 *
 * A row's result depends on its own query and keys alone: not on the batch, the chunk
 * it came in, or the thread that computed it (rows are shared out among threads, each
 * computed whole by one), so serving stays batch-, chunk- and prefix-invariant. Built
 * with -ffp-contract=off: no fused multiply-adds a compiler might choose on its own.
 * The caller checks shapes, strides and that every row index lies in the pool
 * (pdctl/serve/model/native_attention.py).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define LANES 8

typedef struct {
    const float *q, *k, *v;
    float *out;
    int64_t q_stride, kv_stride; /* floats from one row to the next */
    const int64_t *rows, *key_offsets, *query_offsets, *starts;
    int64_t pieces, heads, kv_heads, dim, window;
    float scale;
} attention_t;

static float dot(const float *a, const float *b, int64_t dim) {
    float partial[LANES] = {0};
    int64_t d = 0;
    for (; d + LANES <= dim; d += LANES)
        for (int l = 0; l < LANES; l++)
            partial[l] += a[d + l] * b[d + l];
    for (int l = 0; d < dim; d++, l++)
        partial[l] += a[d] * b[d];
    return ((partial[0] + partial[1]) + (partial[2] + partial[3])) +
           ((partial[4] + partial[5]) + (partial[6] + partial[7]));
}

/* The piece holding query `index`: the last p with query_offsets[p] <= index. */
static int64_t piece_of(const attention_t *a, int64_t index) {
    int64_t low = 0, high = a->pieces - 1;
    while (low < high) {
        int64_t middle = (low + high + 1) / 2;
        if (a->query_offsets[middle] <= index)
            low = middle;
        else
            high = middle - 1;
    }
    return low;
}

/* e^x for x <= 0 (a score less the peak), in plain float operations the compiler can
 * run several lanes at a time: x = n ln2 + r, |r| <= ln2 / 2, e^r by its Taylor
 * series to r^7 (relative error below 1e-8), times 2^n from the exponent bits.
 * Below -87 (e^x < 2^-125, nothing next to the peak's 1) it gives e^-87. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float t = x * 1.44269504f - 0.5f;
    int n = (int)t; /* toward zero: t - 1 < n <= t for t < 0 */
    n = (float)n > t ? n - 1 : n;
    n += 1; /* round(x / ln2) */
    float r = (x - (float)n * 0.693145752f) - (float)n * 1.42860677e-6f;
    float p = 1.98412698e-4f;
    p = p * r + 1.38888889e-3f;
    p = p * r + 8.33333333e-3f;
    p = p * r + 4.16666667e-2f;
    p = p * r + 1.66666667e-1f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { int32_t bits; float value; } scale = {(int32_t)((n + 127) << 23)};
    return p * scale.value;
}

/* Every query head of KV head `kv` for query `index`, the group's heads side by side
 * (each key and value row read once for all of them; each head's sums in its own
 * fixed order). `scores`: room for group x keys. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
static void attend(const attention_t *a, int64_t index, int64_t kv, float *scores) {
    int64_t p = piece_of(a, index);
    int64_t t = a->starts[p] + index - a->query_offsets[p];
    int64_t first = a->window > 0 && t - a->window + 1 > 0 ? t - a->window + 1 : 0;
    int64_t count = t - first + 1, group = a->heads / a->kv_heads, dim = a->dim;
    const int64_t *rows = a->rows + a->key_offsets[p] + first;
    const float *q = a->q + index * a->q_stride + kv * group * dim; /* the group's heads */
    float *out = a->out + index * a->q_stride + kv * group * dim;
    for (int64_t j = 0; j < count; j++) {
        const float *k = a->k + rows[j] * a->kv_stride + kv * dim;
        for (int64_t g = 0; g < group; g++)
            scores[g * count + j] = dot(q + g * dim, k, dim) * a->scale;
    }
    for (int64_t g = 0; g < group; g++) {
        float *row = scores + g * count, peak = -INFINITY;
        for (int64_t j = 0; j < count; j++)
            peak = row[j] > peak ? row[j] : peak;
        for (int64_t j = 0; j < count; j++)
            row[j] = exp_nonpositive(row[j] - peak);
    }
    memset(out, 0, (size_t)(group * dim) * sizeof(float));
    for (int64_t j = 0; j < count; j++) {
        const float *v = a->v + rows[j] * a->kv_stride + kv * dim;
        for (int64_t g = 0; g < group; g++) {
            float weight = scores[g * count + j], *head = out + g * dim;
            for (int64_t d = 0; d < dim; d++)
                head[d] += weight * v[d];
        }
    }
    for (int64_t g = 0; g < group; g++) {
        float norm = 0.0f, *head = out + g * dim;
        for (int64_t j = 0; j < count; j++)
            norm += scores[g * count + j];
        for (int64_t d = 0; d < dim; d++)
            head[d] /= norm;
    }
}

/* Returns 0, or -1 when scratch memory could not be had (nothing written then). */
int pdctl_paged_attention_f32(const float *q, const float *k, const float *v, float *out,
                              int64_t q_stride, int64_t kv_stride, const int64_t *rows,
                              const int64_t *key_offsets, const int64_t *query_offsets,
                              const int64_t *starts, int64_t pieces,
                              int64_t num_queries, int64_t heads, int64_t kv_heads,
                              int64_t dim, float scale, int64_t window, int64_t max_keys,
                              int threads) {
    attention_t a = {q, k, v, out, q_stride, kv_stride, rows, key_offsets, query_offsets,
                     starts, pieces, heads, kv_heads, dim, window, scale};
    int64_t items = num_queries * kv_heads;
    if (threads < 1)
        threads = 1;
    int64_t room = (heads / kv_heads) * (max_keys > 0 ? max_keys : 1); /* floats a thread */
    float *scratch = malloc((size_t)threads * (size_t)room * sizeof(float));
    if (!scratch)
        return -1;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(dynamic, 4) if (threads > 1)
#endif
    for (int64_t item = 0; item < items; item++) {
        int member = 0;
#ifdef _OPENMP
        member = omp_get_thread_num();
#endif
        attend(&a, item / kv_heads, item % kv_heads, scratch + (int64_t)member * room);
    }
    free(scratch);
    return 0;
}
