"""tokenwire's decode engine, no gRPC. Three parts, imported in one direction:

- `engine.core`: requests, events, the stop decision, the `Model` protocol, the scheduler loop
  and its asyncio face; plain Python.
- `engine.model_store`: checkpoints, model files, the model registry and the GGUF converter;
  numpy, no JAX.
- `engine.jax_backend`: the JAX model; imports both of the above.

The layering is checked by import-linter (`.importlinter`, run by tests/test_layering.py).
"""
