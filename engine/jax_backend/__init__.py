"""The JAX model behind `engine.core.model.Model`: the transformer, on-device sampling, the CPU
decode kernels, and the device layout of a checkpoint's weights. The only part of `engine` that
imports JAX."""
