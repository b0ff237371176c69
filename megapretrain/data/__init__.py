"""Data path: tokenizers, Megatron's indexed .bin/.idx format, and packed GPT samples with blending."""

from megapretrain.data.gpt_dataset import (
    BlendedDataset,
    GPTDataset,
    blending_indices,
    build_gpt_datasets,
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
    "BlendedDataset", "GPTDataset", "blending_indices", "build_gpt_datasets", "parse_data_paths",
    "split_document_ids", "IndexedDataset", "IndexedDatasetBuilder", "best_dtype", "data_file_path",
    "dataset_exists", "index_file_path", "TOKENIZER_TYPES", "Tokenizer", "build_tokenizer",
]
