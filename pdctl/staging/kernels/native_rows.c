/* pdctl's CPU staging copy: a row slice of every (buffer, token) between KV buffers
 * and a contiguous staging block, copied per chunk, split over threads.
 *
 *   KV buffer b:  table[b] + row(t) * row_bytes + col_bytes, chunk bytes
 *   staging:      staging + (b * num_tokens + t) * chunk
 *   row(t) = pages[t / page_size] * page_size + t % page_size
 *
 * Rows of a page-1 layout are a few hundred bytes at random places in the pool:
 * each copy prefetches the row PREFETCH_BYTES of items ahead, so the memory system
 * fetches several rows at once instead of waiting for each in turn. The prefetch
 * asks for the outer cache (locality 1: x86's prefetcht2), which can have many more
 * misses in flight than the first level; prefetched into the first level, rows came
 * at two thirds of that rate on the 2-core development machine (a C microbenchmark of
 * the CPU bench's 28 x 2 x 128 gather). A large copy (STREAM_BYTES or more) writes
 * with streaming stores where the chunk and its destination allow (x86: 16-byte
 * multiples at 16-byte addresses):
 * a store that misses the cache otherwise first reads the line it overwrites, a third
 * of the traffic of a copy; the bytes written are not read back before the copy ends.
 * A streamed scatter prefetches nothing: its rows are only written, and a line
 * fetched ahead is a read the streaming store exists to avoid.
 * The caller checks every page id against the pool before calling
 * (pdctl/staging/kernels/native.py).
 */
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define PREFETCH_BYTES 4096 /* how far ahead rows are prefetched: ~ a memory latency of copying */
#define MAX_THREADS 64
#define STREAM_BYTES (4 << 20)

typedef struct {
    const int64_t *table;
    const int64_t *pages;
    uint8_t *staging;
    int64_t num_tokens, page_size, row_bytes, col_bytes, chunk;
    int to_staging, stream;
    int64_t begin, end;
} part_t;

/* A position in the walk over (buffer, token) items, stepped without divisions (an
 * item costs a few hundred cycles of copying; two divisions per item were a third). */
typedef struct {
    int64_t buffer, token, page, slot; /* page: index into pages; slot: row in the page */
} cursor_t;

static cursor_t cursor_at(const part_t *p, int64_t item) {
    cursor_t c;
    c.buffer = item / p->num_tokens;
    c.token = item % p->num_tokens;
    c.page = c.token / p->page_size;
    c.slot = c.token % p->page_size;
    return c;
}

static void step(const part_t *p, cursor_t *c) {
    if (++c->token == p->num_tokens) {
        c->buffer++;
        c->token = c->page = c->slot = 0;
    } else if (++c->slot == p->page_size) {
        c->page++;
        c->slot = 0;
    }
}

static uint8_t *kv_at(const part_t *p, const cursor_t *c) {
    int64_t row = p->pages[c->page] * p->page_size + c->slot;
    return (uint8_t *)(intptr_t)p->table[c->buffer] + row * p->row_bytes + p->col_bytes;
}

/* `bytes` from `source` to `target` with streaming stores (both checked by the caller:
 * bytes a multiple of 16, target 16-byte aligned); memcpy where there are none. */
static void stream_copy(uint8_t *target, const uint8_t *source, int64_t bytes) {
#if defined(__SSE2__)
    int64_t offset = 0;
    for (; offset + 64 <= bytes; offset += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(source + offset));
        __m128i b = _mm_loadu_si128((const __m128i *)(source + offset + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(source + offset + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(source + offset + 48));
        _mm_stream_si128((__m128i *)(target + offset), a);
        _mm_stream_si128((__m128i *)(target + offset + 16), b);
        _mm_stream_si128((__m128i *)(target + offset + 32), c);
        _mm_stream_si128((__m128i *)(target + offset + 48), d);
    }
    for (; offset < bytes; offset += 16)
        _mm_stream_si128((__m128i *)(target + offset),
                         _mm_loadu_si128((const __m128i *)(source + offset)));
#else
    memcpy(target, source, (size_t)bytes);
#endif
}

/* The KV row `distance` items ahead, into the outer cache: to be read (a gather) or
 * written (a scatter without streaming stores). */
static void prefetch_row(const uint8_t *row, int64_t chunk, int for_write) {
    if (for_write) {
        for (int64_t offset = 0; offset < chunk; offset += 64)
            __builtin_prefetch(row + offset, 1, 1);
    } else {
        for (int64_t offset = 0; offset < chunk; offset += 64)
            __builtin_prefetch(row + offset, 0, 1);
    }
}

/* A part's items, `chunk` bytes each. Inlined with the common chunk sizes as constants,
 * so each copy and prefetch loop unrolls; the part is read into locals, since the
 * copy's stores go through byte pointers and could otherwise alias it, making the
 * compiler reload every field after each store (together 1.2-1.5x on the 28 x 2 x 128
 * gather on the 2-core development machine, benchmarks/native_rows_ab.py). */
static inline __attribute__((always_inline)) void copy_items(const part_t *part,
                                                             const int64_t chunk) {
    const part_t p = *part;
    int64_t distance = PREFETCH_BYTES / chunk < 2 ? 2 : PREFETCH_BYTES / chunk;
    int prefetch = p.to_staging || !p.stream; /* a streamed scatter's rows are only written */
    cursor_t now = cursor_at(&p, p.begin), ahead = cursor_at(&p, p.begin + distance);
    for (int64_t item = p.begin; item < p.end; item++) {
        if (prefetch && item + distance < p.end) {
            prefetch_row(kv_at(&p, &ahead), chunk, !p.to_staging);
            step(&p, &ahead);
        }
        uint8_t *kv = kv_at(&p, &now), *staged = p.staging + item * chunk;
        uint8_t *target = p.to_staging ? staged : kv;
        const uint8_t *source = p.to_staging ? kv : staged;
        if (p.stream && ((uintptr_t)target & 15) == 0)
            stream_copy(target, source, chunk);
        else
            memcpy(target, source, (size_t)chunk);
        step(&p, &now);
    }
#if defined(__SSE2__)
    if (p.stream)
        _mm_sfence(); /* streamed bytes visible before the copy is said done */
#endif
}

static void *copy_part(void *arg) {
    const part_t *p = (const part_t *)arg;
    switch (p->chunk) { /* a head's slice: 128 or 256 bytes per head of 64 or 128 */
    case 128: copy_items(p, 128); break;
    case 256: copy_items(p, 256); break;
    case 512: copy_items(p, 512); break;
    case 1024: copy_items(p, 1024); break;
    default: copy_items(p, p->chunk);
    }
    return 0;
}

/* 1 where the copy's threads are OpenMP's: built with -fopenmp, the library shares
 * the OpenMP runtime torch already loaded (the same soname), so a copy runs on torch's
 * own worker threads instead of competing for the cores with them (they spin for a
 * while after each parallel torch op; a copy on threads of its own right after one
 * ran at half its rate on 2 cores). 0: threads of its own (pthreads). */
int pdctl_threading(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* Returns 0, or -1 when a thread of its own could not start (nothing is left half
 * done: the calling thread then copies that thread's part itself; OpenMP's team,
 * however small, shares out every part). */
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
    int stream = 0;
#if defined(__SSE2__)
    stream = total * chunk >= STREAM_BYTES && chunk % 16 == 0;
#endif
    for (int k = 0; k < threads; k++) {
        part_t part = {table, pages, staging, num_tokens, page_size, row_bytes, col_bytes,
                       chunk, to_staging, stream, total * k / threads,
                       total * (k + 1) / threads};
        parts[k] = part;
    }
#ifdef _OPENMP
    if (threads > 1) {
#pragma omp parallel num_threads(threads)
        {
            /* the team may be smaller than asked: its members share out every part */
            int member = omp_get_thread_num(), members = omp_get_num_threads();
            for (int k = member; k < threads; k += members)
                copy_part(&parts[k]);
        }
        return 0;
    }
#endif
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
 * before a copy or a replay reads it), copying them to `out` as it goes where `out` is
 * not null (a replay's pinned slot: the check and the copy read the ids once).
 * stamps: num_pages words, each below `stamp` (the caller's generation for this call,
 * never reused before the words are cleared). Returns -1 when every id lies in
 * [0, num_pages) and none repeats; else the position of the first id outside
 * (*repeated = 0: an id outside wins over a repeat anywhere, as the numpy check reports
 * it), or of the first id seen before (*repeated = 1). */
int64_t pdctl_check_ids(const int64_t *ids, int64_t count, int64_t num_pages,
                        uint32_t *stamps, uint32_t stamp, int *repeated, int64_t *out) {
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
        if (out)
            out[i] = id;
    }
    *repeated = first_repeat >= 0;
    return first_repeat;
}

/* A thread's words for pdctl_check_stamped, owned by its caller (one per thread). */
typedef struct {
    uint32_t *words;
    int64_t size;   /* how many words */
    uint32_t stamp; /* the last generation handed out */
    int repeated;   /* the check's out-parameter */
} pdctl_stamps_t;

/* pdctl_check_ids on a thread's words, taking the next generation here: -2 when the
 * words are too few for num_pages or the generations ran out (the caller gives fresh
 * zeroed words and calls again), else as pdctl_check_ids. The entry point a replay
 * calls from C (pdctl/staging/held_replay.c), so one check serves both ways in. */
int64_t pdctl_check_stamped(const int64_t *ids, int64_t count, int64_t num_pages,
                            pdctl_stamps_t *s, int64_t *out) {
    if (s->size < num_pages || s->stamp == UINT32_MAX)
        return -2;
    s->stamp++;
    return pdctl_check_ids(ids, count, num_pages, s->words, s->stamp, &s->repeated, out);
}
