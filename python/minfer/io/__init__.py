"""Files on disk: GGUF parsing and validation over mmap, the default-model cache."""
