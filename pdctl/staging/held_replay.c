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
 * 28 x 2 x 128 scatter's 75-85 (docs/benchmarks.md, session 17). The entry points
 * come from the caller (libcuda's, looked up by ctypes), so this file links nothing
 * of CUDA; a test passes stand-ins. Returns 0, or the failing step's number times
 * 1000 plus the driver's error (below 1000 for every CUDA error the driver defines);
 * nothing after a failing step runs. */
#include <stddef.h>
#include <stdint.h>

typedef int (*copy_fn)(uint64_t device, const void *host, size_t nbytes, void *stream);
typedef int (*record_fn)(void *event, void *stream);
typedef int (*wait_fn)(void *stream, void *event, unsigned int flags);
typedef int (*launch_fn)(void *graph, void *stream);

typedef struct {
    copy_fn copy;
    record_fn record;
    wait_fn wait;
    launch_fn launch;
    uint64_t device_ids;
    const void *host_ids;
    uint64_t nbytes;
    void *upload_stream, *uploaded, *graph, *done;
} replay_t;

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
