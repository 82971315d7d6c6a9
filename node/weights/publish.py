"""Publishing a version: a model directory (written by the learner) is cut into blake3 chunks, its manifest
signed with the trainer's libp2p key, all of it kept in the trainer's chunk store. No torch here.

int8-grid and int4-grid (node/weights/grid.py): the learner's file becomes MLX int8 (int4) group codes on the grids
of the last published version's file (each group's scale and bias frozen until the re-grid rule replaces them), so
that its patches carry only the codes that changed.

Sparse patches (``patch_max_fraction`` > 0, native or a grid encoding): each version after the first is also
described as a patch of its parent's weights file (the element bits that changed, node/weights/patch.py), computed
from the parent's published file (kept hard-linked under ``<store>/published/``: the exact bits that went out) and
the new one. A version travels as a patch alone, unless an anchor is due: a full version every ``anchor_every``
versions, whenever the patch would be larger than ``patch_max_fraction`` of the weights file, and whenever there is
no parent to patch against (the first version, or a parent whose file fails its hashes after a restart). An anchor
carries its patch too, so nodes holding the parent never download the full weights.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path

from libp2p.crypto.keys import KeyPair

from node.weights.encoding import encode_int8_file
from node.weights.grid import GRID_BITS, GridRule, GridStats, encode_grid_file
from node.weights.hashes import digest, hash_weights
from node.weights.manifest import WEIGHTS_FILE, cut_model_dir, cut_ranges, sign_manifest
from node.weights.patch import OverBudget, build_patch
from node.weights.store import ChunkStore
from protocols.weights import PATCHED_ENCODINGS, Manifest, PatchInfo, SignedManifest
from protocols.weights_file import read_layout

log = logging.getLogger(__name__)


@dataclass
class Parent:
    version: int
    mid: bytes
    manifest: Manifest
    path: Path  # the exact weights file that was published

    @property
    def anchor(self) -> int:
        return self.manifest.patch.anchor if self.manifest.patch is not None else self.version


@dataclass
class PublishStats:
    version: int
    full_bytes: int  # the weights file
    patch_bytes: int | None  # None: no patch
    anchor: bool
    changed: int = 0
    elements: int = 0
    patch_seconds: float = 0.0  # building the patch (compare, encode, compress, hash)
    seconds: float = 0.0  # the whole publish
    grid: GridStats | None = None  # a grid encoding: its tally (groups given a fresh grid, ...)


class Publisher:
    def __init__(
        self,
        store: ChunkStore,
        key_pair: KeyPair,
        swarm_name: str,
        chunk_size: int = 1 << 20,
        encoding: str = "native",
        anchor_every: int = 10,
        patch_max_fraction: float = 0.0,
        patch_codec: str = "zlib",
        grid_rule: GridRule | None = None,
        tag: str = "",
    ) -> None:
        """``tag``: a second publisher beside the trainer's first (another encoding of the same versions) keeps its
        staging dirs and published files under names of its own."""
        self.store = store
        self.key_pair = key_pair
        self.swarm_name = swarm_name
        self.chunk_size = chunk_size
        self.encoding = encoding
        self.anchor_every = max(1, anchor_every)
        self.patch_max_fraction = patch_max_fraction
        self.patch_codec = patch_codec
        self.grid_rule = grid_rule  # None: the grid width's own (grid.rule_for)
        self.last_version = -1
        self.tag = tag
        self.links = store.root / (f"published-{tag}" if tag else "published")
        self._parent: Parent | None = None
        self.last_stats: PublishStats | None = None
        self._next_patch_try = 0  # versions before this one skip the diff (after patches over the budget)
        self._patch_backoff = 1

    @property
    def patches(self) -> bool:
        return self.patch_max_fraction > 0 and self.encoding in PATCHED_ENCODINGS

    def staging_dir(self, version: int) -> Path:
        """Where the learner writes the model directory of ``version`` for ``publish`` to take."""
        return self.store.root / (f"publish-{self.tag}-v{version}" if self.tag else f"publish-v{version}")

    def parent(self) -> Parent | None:
        """The last published version with its weights file, if that file still holds exactly its bits (checked
        once against its manifest's hashes after a restart)."""
        if self._parent is not None or not self.patches:
            return self._parent
        latest = self.store.latest(self.encoding)
        if latest is None:
            return None
        mid, _, manifest = latest
        path = self.links / f"v{manifest.version}.safetensors"
        if not path.exists() or not manifest.tensors or not all(t.hash for t in manifest.tensors):
            return None
        try:
            _head, layout = read_layout(path)
            header_hash, hashes = hash_weights(path, layout)
        except Exception:
            return None
        if [t.hash for t in manifest.tensors] != hashes or (
            manifest.patch is not None and manifest.patch.header_hash != header_hash
        ):
            log.warning("version %d's published file fails its hashes: the next version is an anchor", manifest.version)
            return None
        self._parent = Parent(manifest.version, mid, manifest, path)
        self.last_version = max(self.last_version, manifest.version)
        return self._parent

    def publish(self, model_dir: Path, version: int) -> tuple[bytes, SignedManifest, Manifest]:
        """Blocking (run it in a thread). Consumes ``model_dir``; returns (manifest id, signed manifest, manifest)."""
        t0 = time.perf_counter()
        weights = model_dir / WEIGHTS_FILE
        if self.encoding == "int8":
            encoded = weights.with_name(weights.name + ".int8")
            encode_int8_file(weights, encoded)
            os.replace(encoded, weights)  # it may be a hard link to the learner's own copy: never write through it
        parent = self.parent() if self.patches else None
        grid = None
        if self.encoding in GRID_BITS:  # on the parent's grids (a parent of another layout: fresh ones)
            encoded = weights.with_name(weights.name + ".grid")
            parent_file = parent.path if parent is not None else None
            grid = encode_grid_file(weights, encoded, parent_file, self.grid_rule, bits=GRID_BITS[self.encoding])
            os.replace(encoded, weights)
        full_bytes = weights.stat().st_size
        built, patch_seconds = None, 0.0
        if parent is not None and parent.version < version and version >= self._next_patch_try:
            t1 = time.perf_counter()
            try:
                built = build_patch(parent.path, weights, self.patch_codec, int(self.patch_max_fraction * full_bytes))
                self._patch_backoff = 1
            except OverBudget as exc:
                # dense changes (fp32 weights, a high learning rate): try again after 1, 2, 4, ... versions, so a
                # trainer whose patches never pay stops paying for the diff
                log.info("version %d: the patch is %s of the weights: publishing an anchor (%s)", version,
                         f"over {100 * self.patch_max_fraction:.0f}%", exc)  # fmt: skip
                self._next_patch_try = version + self._patch_backoff
                self._patch_backoff = min(2 * self._patch_backoff, self.anchor_every)
            patch_seconds = time.perf_counter() - t1
        anchor = built is None or version - parent.anchor >= self.anchor_every
        cut = cut_model_dir(
            model_dir, self.chunk_size, self.store.put_hashed, skip=frozenset() if anchor else {WEIGHTS_FILE}
        )
        if built is not None:
            header_hash, hashes = built.header_hash, built.hashes
        else:
            header_hash, hashes = hash_weights(weights, cut.tensors)
        tensors = [replace(t, hash=h) for t, h in zip(cut.tensors, hashes, strict=True)]
        patch = None
        if built is not None:
            chunks = []
            try:
                for piece in built.pieces(cut_ranges(built.size, [], self.chunk_size)):
                    h = digest(piece)
                    self.store.put_hashed(h, piece)
                    chunks.append(h)
            finally:
                built.close()
            patch = PatchInfo(
                parent_id=parent.mid,
                anchor=version if anchor else parent.anchor,
                codec=self.patch_codec,
                size=built.size,
                chunks=chunks,
                weights_size=built.weights_size,
                header_hash=header_hash,
                deltas=built.deltas,
            )
        manifest = Manifest(
            self.swarm_name,
            version,
            parent.version if built is not None else self.last_version,
            self.encoding,
            self.chunk_size,
            cut.files,
            tensors,
            patch,
        )  # "native": the file's own dtypes (bf16 or fp32, as the learner published)
        signed = sign_manifest(manifest, self.key_pair)
        mid = self.store.add_manifest(signed, manifest)
        if self.patches:
            self._keep_parent(weights, Parent(version, mid, manifest, self.links / f"v{version}.safetensors"))
        shutil.rmtree(model_dir, ignore_errors=True)
        self.last_version = version
        self.last_stats = PublishStats(
            version,
            full_bytes,
            built.size if built is not None else None,
            anchor,
            built.changed if built is not None else 0,
            built.elements if built is not None else 0,
            patch_seconds,
            time.perf_counter() - t0,
            grid,
        )
        return mid, signed, manifest

    def _keep_parent(self, weights: Path, parent: Parent) -> None:
        """Keep the just-published weights file (a hard link: the learner writes each version's file once, by
        atomic rename, so these bits never change under us) as the next version's parent; drop older ones."""
        self.links.mkdir(parents=True, exist_ok=True)
        tmp = parent.path.with_suffix(".tmp")
        tmp.unlink(missing_ok=True)
        try:
            os.link(weights, tmp)
        except OSError:
            shutil.copyfile(weights, tmp)
        os.replace(tmp, parent.path)
        for old in self.links.glob("v*.safetensors"):
            if old != parent.path:
                old.unlink(missing_ok=True)
        self._parent = parent
