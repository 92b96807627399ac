"""Data pipeline: sources and formats, DS-Chat's --data_split, tokenisation, cache, collators.

Public API (other modules import from here):
    create_prompt_dataset, create_unsupervised_dataset, PromptDataset, BlockDataset,
    DataCollatorSFT, DataCollatorReward, DataCollatorRLHF,
    load_source, parse_data_split, BUNDLED_DATASET_NAME, bundled_tokenizer_path,
    bundled_dataset_path
"""
from dschat.data.assets import BUNDLED_DATASET_NAME, bundled_dataset_path, bundled_tokenizer_path
from dschat.data.collators import DataCollatorReward, DataCollatorRLHF, DataCollatorSFT
from dschat.data.datasets import (
                                  BlockDataset,
                                  PromptDataset,
                                  create_prompt_dataset,
                                  create_unsupervised_dataset,
                                  prompt_cache_dir,
)
from dschat.data.formats import Row, detect_format, split_conversation_pair
from dschat.data.sources import NAMED_DATASETS, Source, load_source, resolve_entry
from dschat.data.split import parse_data_split

__all__ = [
    "BUNDLED_DATASET_NAME", "bundled_dataset_path", "bundled_tokenizer_path",
    "DataCollatorReward", "DataCollatorRLHF", "DataCollatorSFT",
    "BlockDataset", "PromptDataset", "create_prompt_dataset", "create_unsupervised_dataset",
    "prompt_cache_dir", "Row", "detect_format", "split_conversation_pair",
    "NAMED_DATASETS", "Source", "load_source", "resolve_entry", "parse_data_split",
]
