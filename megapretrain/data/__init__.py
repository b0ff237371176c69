"""Data path: tokenizers, Megatron's indexed .bin/.idx format, and packed GPT samples with blending.

The torch-side loader lives in ``megapretrain.data.sampler`` (not imported here, so that
preprocessing tools start without importing torch).
"""

from megapretrain.data.gpt_dataset import (
    BlendedDataset,
    GPTDataset,
    blending_indices,
    build_gpt_datasets,
    describe_datasets,
    format_description,
    parse_data_paths,
    split_document_ids,
)
from megapretrain.data.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetBuilder,
    best_dtype,
    data_file_path,
    dataset_exists,
    index_file_path,
)
from megapretrain.data.tokenizers import TOKENIZER_TYPES, Tokenizer, build_tokenizer

__all__ = [
    "BlendedDataset", "GPTDataset", "blending_indices", "build_gpt_datasets", "describe_datasets",
    "format_description", "parse_data_paths",
    "split_document_ids", "IndexedDataset", "IndexedDatasetBuilder", "best_dtype", "data_file_path",
    "dataset_exists", "index_file_path", "TOKENIZER_TYPES", "Tokenizer", "build_tokenizer",
]
