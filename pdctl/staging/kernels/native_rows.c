/* pdctl's CPU staging copy: a row slice of every (buffer, token) between KV buffers
 * and a contiguous staging block, memcpy per chunk, split over threads.
 *
 *   KV buffer b:  table[b] + row(t) * row_bytes + col_bytes, chunk bytes
 *   staging:      staging + (b * num_tokens + t) * chunk
 *   row(t) = pages[t / page_size] * page_size + t % page_size
 *
 * Rows of a page-1 layout are a few hundred bytes at random places in the pool:
 * each copy prefetches the row PREFETCH_AHEAD items ahead, so the memory system
 * fetches several rows at once instead of waiting for each in turn. The caller
 * checks every page id against the pool before calling (pdctl/staging/kernels/native.py).
 */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define PREFETCH_AHEAD 8
#define MAX_THREADS 64

typedef struct {
    const int64_t *table;
    const int64_t *pages;
    uint8_t *staging;
    int64_t num_tokens, page_size, row_bytes, col_bytes, chunk;
    int to_staging;
    int64_t begin, end;
} part_t;

static uint8_t *kv_at(const part_t *p, int64_t item) {
    int64_t buffer = item / p->num_tokens, token = item % p->num_tokens;
    int64_t row = p->pages[token / p->page_size] * p->page_size + token % p->page_size;
    return (uint8_t *)(intptr_t)p->table[buffer] + row * p->row_bytes + p->col_bytes;
}

static void *copy_part(void *arg) {
    const part_t *p = (const part_t *)arg;
    for (int64_t item = p->begin; item < p->end; item++) {
        if (item + PREFETCH_AHEAD < p->end) {
            const uint8_t *ahead = kv_at(p, item + PREFETCH_AHEAD);
            for (int64_t offset = 0; offset < p->chunk; offset += 64)
                __builtin_prefetch(ahead + offset, 0, 0);
        }
        uint8_t *kv = kv_at(p, item), *staged = p->staging + item * p->chunk;
        if (p->to_staging)
            memcpy(staged, kv, (size_t)p->chunk);
        else
            memcpy(kv, staged, (size_t)p->chunk);
    }
    return 0;
}

/* Returns 0, or -1 when a thread could not start (nothing is left half done: the
 * calling thread then copies that thread's part itself). */
int pdctl_copy_rows(const int64_t *table, const int64_t *pages, uint8_t *staging,
                    int64_t num_buffers, int64_t num_tokens, int64_t page_size,
                    int64_t row_bytes, int64_t col_bytes, int64_t chunk, int to_staging,
                    int threads) {
    part_t parts[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    int64_t total = num_buffers * num_tokens;
    int status = 0;
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    for (int k = 0; k < threads; k++) {
        part_t part = {table, pages, staging, num_tokens, page_size, row_bytes, col_bytes,
                       chunk, to_staging, total * k / threads, total * (k + 1) / threads};
        parts[k] = part;
    }
    for (int k = 1; k < threads; k++)
        started[k] = pthread_create(&ids[k], 0, copy_part, &parts[k]) == 0;
    copy_part(&parts[0]);
    for (int k = 1; k < threads; k++) {
        if (started[k]) {
            pthread_join(ids[k], 0);
        } else {
            copy_part(&parts[k]);
            status = -1;
        }
    }
    return status;
}

/* Range and duplicate check of page ids in one pass (every host page list is checked
 * before a copy or a replay reads it). stamps: num_pages words, each below `stamp`
 * (the caller's generation for this call, never reused before the words are cleared).
 * Returns -1 when every id lies in [0, num_pages) and none repeats; else the position of
 * the first id outside (*repeated = 0: an id outside wins over a repeat anywhere, as the
 * numpy check reports it), or of the first id seen before (*repeated = 1). */
int64_t pdctl_check_ids(const int64_t *ids, int64_t count, int64_t num_pages,
                        uint32_t *stamps, uint32_t stamp, int *repeated) {
    int64_t first_repeat = -1;
    for (int64_t i = 0; i < count; i++) {
        int64_t id = ids[i];
        if (id < 0 || id >= num_pages) {
            *repeated = 0;
            return i;
        }
        if (stamps[id] == stamp) {
            if (first_repeat < 0)
                first_repeat = i;
        } else {
            stamps[id] = stamp;
        }
    }
    *repeated = first_repeat >= 0;
    return first_repeat;
}
