"""Document masking in packed samples: attention stays inside a document, positions restart, and
the end-of-document target can leave the loss — equal to running each document on its own, and
the same under tensor and pipeline parallelism as in one process (the cases tp2_sp_documents
and pp2_documents of tests/layouts.py)."""

from __future__ import annotations

import pytest
import torch

from megapretrain.model.decoder import documents
from megapretrain.parallel.state import ParallelState

from helpers import VOCAB, build, check, tiny_args, train_layout

EOD = 7


def test_positions_and_mask_follow_the_documents():
    tokens = torch.tensor([[1, 2, EOD, 3, 4, 5, EOD, 6]])
    docs = documents(tokens, EOD, True, True)
    assert docs.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]
    mask = docs.mask.dense()[0, 0]
    assert mask[4].tolist() == [False, False, False, True, True, False, False, False]
    assert mask[2].tolist() == [True, True, True, False, False, False, False, False]  # EOD ends its document
    assert mask.sum() == 6 + 10 + 1  # causal inside each document: 3·4/2 + 4·5/2 + 1


def test_a_packed_sample_computes_what_each_document_alone_does():
    """The per-token losses of two documents packed into one sample equal those of each run alone."""
    torch.manual_seed(0)
    model = build(ParallelState(), tiny_args())
    a = torch.tensor([5, 9, 11, 40, EOD])
    b = torch.tensor([13, 2, 99, 150, 8, 3, EOD])
    packed = torch.cat([a, b]).unsqueeze(0)  # (1, 12): inputs are all but the last
    inputs, targets = packed[:, :-1], packed[:, 1:]
    docs = documents(inputs, EOD, True, True)
    together = model(inputs, targets, docs)[0]
    first = model(a[:-1].unsqueeze(0), a[1:].unsqueeze(0))[0]
    second = model(b[:-1].unsqueeze(0), b[1:].unsqueeze(0))[0]
    torch.testing.assert_close(together[:4], first, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(together[5:], second, rtol=1e-5, atol=1e-5)
    plain = model(inputs, targets)[0]  # without masking, the second document sees the first
    assert not torch.allclose(plain[5:], second, atol=1e-3)
    assert VOCAB > 150


DOCS = ["--data.reset_attention_mask", "true", "--data.reset_position_ids", "true", "--data.eod_mask_loss", "true"]


@pytest.fixture(scope="module")
def single(corpus, tmp_path_factory):
    return train_layout(0, 1, str(tmp_path_factory.mktemp("docs_single")), corpus, DOCS)


def test_the_dense_mask_and_the_blockwise_kernel_train_alike(single, corpus, tmp_path):
    """model.attention=sdpa (the dense (b, 1, s, s) mask) trains as auto does on CPU (blockwise)."""
    check(single, [train_layout(0, 1, str(tmp_path), corpus, [*DOCS, "--model.attention", "sdpa"])])


def test_masking_changes_the_loss(single, corpus, tmp_path):
    plain = train_layout(0, 1, str(tmp_path), corpus, [])
    assert plain["losses"][0] != pytest.approx(single["losses"][0], rel=1e-4)
