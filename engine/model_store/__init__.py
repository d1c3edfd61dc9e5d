"""Models on disk, without JAX: Hugging Face checkpoint reading (as numpy), what a model
directory says about its EOS ids, the registry of named models with `pull`, and the GGUF
converter that `pull` uses. Both processes use it: the decode service to load weights, the
text service to find its tokenizer's directory and EOS ids."""
