"""Publishing a policy version: save the model as an HF checkpoint, cut it into blake3 chunks, sign the
manifest with the trainer's libp2p key, keep it all in the trainer's chunk store."""

from __future__ import annotations

import shutil
from pathlib import Path

from libp2p.crypto.keys import KeyPair
from safetensors.torch import save_file
from transformers import PreTrainedModel

from node.weights.encoding import encode_int8
from node.weights.manifest import WEIGHTS_FILE, cut_checkpoint, sign_manifest
from node.weights.store import ChunkStore
from protocols.weights import Manifest, SignedManifest
from trainer.tiny_model import flatten_rope_theta

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


class Publisher:
    def __init__(
        self,
        store: ChunkStore,
        key_pair: KeyPair,
        swarm_name: str,
        source_dir: Path,
        chunk_size: int = 1 << 20,
        encoding: str = "fp32",
    ) -> None:
        self.store = store
        self.key_pair = key_pair
        self.swarm_name = swarm_name
        self.source_dir = Path(source_dir)
        self.chunk_size = chunk_size
        self.encoding = encoding
        self.last_version = -1

    def publish(self, model: PreTrainedModel, version: int) -> tuple[bytes, SignedManifest, Manifest]:
        """Blocking (run it in a thread): returns (manifest id, signed manifest, manifest)."""
        out = self.store.root / f"publish-v{version}"
        shutil.rmtree(out, ignore_errors=True)
        model.save_pretrained(out)
        for name in TOKENIZER_FILES:
            if (self.source_dir / name).exists() and not (out / name).exists():
                shutil.copy(self.source_dir / name, out / name)
        flatten_rope_theta(out)
        if self.encoding == "int8":
            state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
            if model.config.tie_word_embeddings:
                state.pop("lm_head.weight", None)
            save_file(encode_int8(state), str(out / WEIGHTS_FILE), metadata={"format": "pt"})
        cut = cut_checkpoint(out, self.chunk_size)
        self.store.put_verified(cut.chunks)
        manifest = Manifest(
            self.swarm_name, version, self.last_version, self.encoding, self.chunk_size, cut.files, cut.tensors
        )
        signed = sign_manifest(manifest, self.key_pair)
        mid = self.store.add_manifest(signed, manifest)
        shutil.rmtree(out, ignore_errors=True)
        self.last_version = version
        return mid, signed, manifest
