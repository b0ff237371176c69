"""Shared fixtures: a small byte-level corpus written in the indexed format."""

from __future__ import annotations

import numpy as np
import pytest

WORDS = ("def return import class self value index tensor rank batch layer model data token "
         "loss grad step seed shard group split merge print while for if else").split()


def write_corpus(prefix: str, num_docs: int = 300, seed: int = 0) -> str:
    """Documents of pseudo-code lines (learnable structure), byte-tokenized with EOS=256."""
    from megapretrain.data.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    for _ in range(num_docs):
        lines = []
        for _ in range(int(rng.integers(2, 12))):
            words = rng.choice(WORDS, size=int(rng.integers(2, 7)))
            lines.append("    " * int(rng.integers(0, 3)) + " ".join(words) + "(x)")
        tokens = list("\n".join(lines).encode()) + [256]
        builder.add_document(tokens)
    builder.finalize(prefix + ".idx")
    return prefix


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> str:
    """Prefix of a ~30k-token byte-level corpus (ByteTokenizer ids, EOS 256)."""
    return write_corpus(str(tmp_path_factory.mktemp("corpus") / "code_text_document"))
