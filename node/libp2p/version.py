"""The one version check: every patch and private read in node/libp2p/ was derived from this py-libp2p release."""

from __future__ import annotations

import importlib.metadata

LIBP2P_VERSION = "0.8.1"


def check_version() -> None:
    """Refuse to patch any other py-libp2p: each replacement mirrors upstream code that may have changed."""
    found = importlib.metadata.version("libp2p")
    if found != LIBP2P_VERSION:
        raise RuntimeError(
            f"node/libp2p/ was written against libp2p=={LIBP2P_VERSION}, found {found}: for each row of "
            "node.libp2p.patches.PATCHES check whether upstream fixed the bug (its docs/upstream/ report says how to "
            "tell), then update or drop the patch and the pin"
        )
