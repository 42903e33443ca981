"""Pure data and codecs, no I/O beyond reading one header: safetensors headers and HF index files, the dtype table, the key-path tree, the shard layout."""
