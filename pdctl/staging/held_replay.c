/* A captured staging call's replay in one call from Python (pdctl/staging/held_replay.py):
 *
 *   1. the slot's ids copied from its pinned memory to the device, on the upload stream
 *   2. an event recorded there behind the copy
 *   3. the launching stream made to wait for that event (nothing else)
 *   4. the graph launched on the launching stream
 *   5. the slot's event recorded behind it
 *
 * Five CUDA driver calls that Python made one by one through ctypes, each with its
 * own conversions and status check: on the H200's host those cost 20-27 us of a
 * 28 x 2 x 128 scatter's 75-85 (benchmarks/staging_replay_ab.py times both ways).
 * The entry points come from the caller (libcuda's, looked up by ctypes), so this
 * file links nothing of CUDA; a test passes stand-ins. Returns 0, or the failing step's number times
 * 1000 plus the driver's error (below 1000 for every CUDA error the driver defines);
 * nothing after a failing step runs.
 *
 * pdctl_checked_replay does a replay's host work before that in the same call: the
 * slot's event queried (its last replay read the slot's ids), the call's page ids
 * checked and written into the slot's pinned ids in one pass (the page check of
 * pdctl/staging/kernels/native_rows.c, handed over as an address like the driver's),
 * then the five calls. A 28 x 2 x 128 scatter's host work was the check (28-34 us on
 * the H200's host), the replay (one C call) and the Python between them, against 62 us
 * of the device's (benchmarks/staging_e2e_profile.py). */
#include <stddef.h>
#include <stdint.h>

typedef int (*copy_fn)(uint64_t device, const void *host, size_t nbytes, void *stream);
typedef int (*record_fn)(void *event, void *stream);
typedef int (*wait_fn)(void *stream, void *event, unsigned int flags);
typedef int (*launch_fn)(void *graph, void *stream);
typedef int (*query_fn)(void *event);
/* ids, count, pages in the pool, a thread's stamp words, where the ids go: -1 when every
 * id is good, -2 when the words are too few, else the first bad id's position */
typedef int64_t (*check_fn)(const int64_t *ids, int64_t count, int64_t num_pages,
                            void *stamps, int64_t *out);

typedef struct {
    copy_fn copy;
    record_fn record;
    wait_fn wait;
    launch_fn launch;
    uint64_t device_ids;
    void *host_ids; /* the slot's pinned ids */
    uint64_t nbytes;
    void *upload_stream, *uploaded, *graph, *done;
    query_fn query;
    check_fn check;
    int64_t count; /* the slot's ids: nbytes / 8 */
} replay_t;

#define CUDA_ERROR_NOT_READY 600
enum { REPLAYED = 0, SLOT_BUSY = 1, FEW_STAMPS = 2, IDS_REFUSED = 3 };

static int failed(int step, int error) {
    return step * 1000 + (error >= 0 && error < 1000 ? error : 999);
}

int pdctl_replay(const replay_t *r, void *stream) {
    int error;
    if ((error = r->copy(r->device_ids, r->host_ids, (size_t)r->nbytes, r->upload_stream)))
        return failed(1, error);
    if ((error = r->record(r->uploaded, r->upload_stream)))
        return failed(2, error);
    if ((error = r->wait(stream, r->uploaded, 0)))
        return failed(3, error);
    if ((error = r->launch(r->graph, stream)))
        return failed(4, error);
    if ((error = r->record(r->done, stream)))
        return failed(5, error);
    return 0;
}

/* The slot's replay with `ids` (the slot's count of them) checked against a pool of
 * num_pages and written into its pinned ids first. Returns REPLAYED; SLOT_BUSY when
 * the device has not yet passed the slot's last replay (its ids may still be unread:
 * the caller waits, without holding the GIL, and calls again); FEW_STAMPS (the caller
 * gives the thread fresh stamp words and calls again); IDS_REFUSED when an id lies
 * outside the pool or repeats (nothing launched: the caller's own check names it);
 * else a failing step as pdctl_replay says it, the query being step 6. */
int pdctl_checked_replay(const replay_t *r, const int64_t *ids, int64_t num_pages,
                         void *stamps, void *stream) {
    int error = r->query(r->done);
    if (error == CUDA_ERROR_NOT_READY)
        return SLOT_BUSY;
    if (error)
        return failed(6, error);
    int64_t found = r->check(ids, r->count, num_pages, stamps, r->host_ids);
    if (found == -2)
        return FEW_STAMPS;
    if (found != -1)
        return IDS_REFUSED;
    return pdctl_replay(r, stream);
}
