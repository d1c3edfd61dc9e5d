"""The engine core: plain Python, importable without JAX or gRPC.

Data flow: `Request` -> `Engine.submit` -> scheduler loop (engine thread) ->
`Model.prefill` / `Model.decode` -> sampled ids -> `stopping.decide` ->
`Token` / `Finished` events -> the caller's event sink (`AsyncEngine` for asyncio callers); the
scheduler gives every request its KV pages (`kv_pages.KvPages`) and tells the model where they are.
Any object with the `Model` interface can sit behind it: `engine.jax_backend.JaxModel`, or the
`ScriptedModel` fake whose outputs are worked out by hand.
"""
