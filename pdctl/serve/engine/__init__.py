"""The engine: requests in, batches through the model, tokens out.

    request.py     a request's state inside the engine and the events it reports
    sampling.py    sampling parameters and the choice of a token from logits
    kv_pool.py     the paged KV pool, the page allocator and req_to_token slots
    radix.py       the page-aligned prefix cache over the pool's pages
    scheduler.py   which requests run in the next forward, and how much of each
    loop.py        `Engine`: the scheduler thread, the forward, sampling, events

The engine calls the model through a `forward(pieces)` callable; it knows nothing
about HTTP, how ranks communicate, or what the model computes.
"""
