"""The HTTP API of pdctl's embedded servers, one module per part.

errors (BadRequest, the error body), guards (body size, JSON depth; torch-free, the
router uses them), schemas / openai_schemas / fields (the request models),
submission (a request in the engine and its outcome), generate (SGLang's /generate),
completions and chat (OpenAI's), models (/v1/models), admin (health, info, cache,
metrics) and app (create_app, which mounts them). Importing this package imports
nothing: the router takes the guards without the engine.
"""
