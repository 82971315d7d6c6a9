"""Weight distribution: content-addressed blake3 chunks, signed manifests, swarming downloads, re-serving."""
