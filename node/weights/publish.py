"""Publishing a version: a model directory (written by the learner) is cut into blake3 chunks, its manifest
signed with the trainer's libp2p key, all of it kept in the trainer's chunk store. No torch here."""

from __future__ import annotations

import shutil
from pathlib import Path

from libp2p.crypto.keys import KeyPair
from safetensors.numpy import save_file

from node.weights.encoding import encode_int8, read_float_tensors
from node.weights.manifest import WEIGHTS_FILE, cut_model_dir, sign_manifest
from node.weights.store import ChunkStore
from protocols.weights import Manifest, SignedManifest


class Publisher:
    def __init__(
        self, store: ChunkStore, key_pair: KeyPair, swarm_name: str, chunk_size: int = 1 << 20, encoding: str = "native"
    ) -> None:
        self.store = store
        self.key_pair = key_pair
        self.swarm_name = swarm_name
        self.chunk_size = chunk_size
        self.encoding = encoding
        self.last_version = -1

    def staging_dir(self, version: int) -> Path:
        """Where the learner writes the model directory of ``version`` for ``publish`` to take."""
        return self.store.root / f"publish-v{version}"

    def publish(self, model_dir: Path, version: int) -> tuple[bytes, SignedManifest, Manifest]:
        """Blocking (run it in a thread). Consumes ``model_dir``; returns (manifest id, signed manifest, manifest)."""
        if self.encoding == "int8":
            weights = model_dir / WEIGHTS_FILE
            encoded = encode_int8(read_float_tensors(weights))
            weights.unlink()  # it may be a hard link to the learner's own copy: never write through it
            save_file(encoded, str(weights), metadata={"format": "pt"})
        cut = cut_model_dir(model_dir, self.chunk_size, self.store.put_hashed)
        manifest = Manifest(
            self.swarm_name, version, self.last_version, self.encoding, self.chunk_size, cut.files, cut.tensors
        )  # "native": the file's own dtypes (bf16 or fp32, as the learner published)
        signed = sign_manifest(manifest, self.key_pair)
        mid = self.store.add_manifest(signed, manifest)
        shutil.rmtree(model_dir, ignore_errors=True)
        self.last_version = version
        return mid, signed, manifest
