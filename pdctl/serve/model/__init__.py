"""The model: what one forward computes, and nothing about who asked for it.

    weights.py            one TP rank's weights, from a seed (presets) or a checkpoint
    batch.py              `Piece` and `ForwardBatch`: what a forward is given, on the device
    runner.py             `ModelRunner`: the Llama-style decoder over paged KV
    ops.py                batch-invariant primitives (products, norms, RoPE)
    attention.py          attention of a whole batch over paged KV; the encoder's dense one
    triton_matmul.py      the fixed-order Triton product behind `ops` on CUDA and XPU
    triton_attention.py   the one-launch paged attention kernel behind `attention`
    encoder.py            the small image encoder of EPD topologies

The model reads and writes the KV pool's per-layer buffers through the rows each
piece names; it does not know about pages, requests, scheduling or HTTP (that is
`serve/engine/`).
"""
