"""tokenwire's decode engine: pure Python + JAX, no gRPC.

Data flow: `Request` -> `Engine.submit` -> scheduler loop (engine thread) ->
`Model.prefill` / `Model.decode` -> sampled ids -> `stopping.decide` ->
`Token` / `Finished` events -> the caller's event sink.
"""
