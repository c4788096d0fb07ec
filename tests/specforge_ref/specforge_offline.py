"""Verbatim copies of SpecForge's offline EAGLE-3 loading path, so tests load hsdump's
`--format specforge` output exactly as SpecForge's trainer does (test-only, never shipped).

Source: https://github.com/sgl-project/SpecForge at commit a6b6b0230009d15ec2a97a57384e6f53f0f96946
(Apache-2.0, Copyright 2024 The SpecForge team; parts adapted by SpecForge from EleutherAI
GPT-NeoX / SafeAILab EAGLE, see the files). Copied unchanged except for this header, the
imports each block needs, and no distributed groups (SpecForge reads them only when
torch.distributed is initialized; the stubs below raise if ever called).

* `list_feature_files`: specforge/runtime/data_plane/offline_reader.py (the trainer's listing)
* `load_feature_file`: specforge/runtime/data_plane/feature_store.py (reads one file)
* `normalize_offline_sample`: specforge/algorithms/eagle3/data.py (per-sample processing)
* `DataCollatorWithPadding`: specforge/data/utils.py (the offline EAGLE-3 collator, returned by
  build_offline_collator in specforge/algorithms/eagle3/data.py)
* `list_local_files`, `process_data`: specforge/data/preprocessing.py (the older
  OfflineEagle3Dataset path, still in the tree)
"""
# ruff: noqa

from __future__ import annotations

import gzip
import io
import os
from typing import Any, Dict, List

import torch


def get_draft_sp_group():  # stub: only used under torch.distributed
    raise RuntimeError("distributed groups are not available in tests")


get_sp_ulysses_group = get_draft_sp_group

_FEATURE_SUFFIXES = (".ckpt", ".ckpt.gz")


# --- specforge/runtime/data_plane/offline_reader.py
def list_feature_files(path: str) -> List[str]:
    """Deterministically (sorted) list feature files under ``path``."""
    if os.path.isfile(path):
        return [os.path.abspath(path)]
    files: List[str] = []
    for root, _dirs, names in os.walk(path):
        for name in names:
            if name.endswith(_FEATURE_SUFFIXES):
                files.append(os.path.abspath(os.path.join(root, name)))
    files.sort()  # deterministic, stable cross-rank ordering
    return files


# --- specforge/runtime/data_plane/feature_store.py
def load_feature_file(path: str) -> Dict[str, torch.Tensor]:
    """Load one prepared SpecForge offline feature file."""
    if path.endswith(".gz"):
        with gzip.open(path, "rb") as f:
            return torch.load(io.BytesIO(f.read()), weights_only=False)
    return torch.load(path, weights_only=False, mmap=True)


# --- specforge/algorithms/eagle3/data.py
def normalize_offline_sample(raw, max_len: int):
    """Map the stored target states to the EAGLE3 training tensor names."""

    import torch

    hidden_state = raw["aux_hidden_state"].squeeze(0)[:max_len].unsqueeze(0)
    target = raw["hidden_state"].squeeze(0)[:max_len].unsqueeze(0)
    input_ids = raw["input_ids"][:max_len].unsqueeze(0)
    loss_mask = raw["loss_mask"][:max_len].clone().unsqueeze(0)
    if loss_mask.numel() > 0:
        loss_mask[0, -1] = 0
    return {
        "attention_mask": torch.ones_like(loss_mask, dtype=torch.long),
        "loss_mask": loss_mask,
        "target": target,
        "hidden_state": hidden_state,
        "input_ids": input_ids,
    }


# --- specforge/data/utils.py
class DataCollatorWithPadding:
    """
    Datacollator that will dynamically pad the inputs for batching.
    """

    def __init__(self):
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            self.sp_degree = torch.distributed.get_world_size(get_draft_sp_group())
            self.ulysses_degree = torch.distributed.get_world_size(
                get_sp_ulysses_group()
            )
        else:
            self.sp_degree = 1
            self.ulysses_degree = 1

    def paddingtensor(self, intensors: torch.Tensor, N: int) -> torch.Tensor:
        """
        Pad to the longest sequence in the batch.

        Args:
            intensors: (B, n, S)
            N: the length to pad to, N >= n

        Returns:
            outtensors: (B, N, S)
        """
        B, n, S = intensors.shape
        padding_tensor = torch.zeros(
            B, N - n, S, dtype=intensors.dtype, device=intensors.device
        )
        outtensors = torch.cat((intensors, padding_tensor), dim=1)
        return outtensors

    def paddingtensor2D(self, intensors: torch.Tensor, N: int) -> torch.Tensor:
        """
        Pad 2D tensor to the longest sequence in the batch.

        Args:
            intensors: (B, n)
            N: the length to pad to, N >= n

        Returns:
            outtensors: (B, N)
        """
        B, n = intensors.shape
        padding_tensor = torch.zeros(
            B, N - n, dtype=intensors.dtype, device=intensors.device
        )
        outtensors = torch.cat((intensors, padding_tensor), dim=1)
        return outtensors

    def padding_position_ids_3d(
        self, position_ids: torch.Tensor, length: int
    ) -> torch.Tensor:
        """Pad position IDs on their final sequence dimension."""
        if position_ids.ndim != 3:
            raise ValueError(
                "3D position_ids must have shape [axes, batch, sequence], got "
                f"{tuple(position_ids.shape)}"
            )
        padding_length = length - position_ids.shape[-1]
        if padding_length < 0:
            raise ValueError(
                f"cannot pad position_ids of length {position_ids.shape[-1]} "
                f"to shorter length {length}"
            )
        padding = torch.zeros(
            *position_ids.shape[:-1],
            padding_length,
            dtype=position_ids.dtype,
            device=position_ids.device,
        )
        return torch.cat((position_ids, padding), dim=-1)

    def __call__(self, features: List[Dict[str, Any]]) -> Dict[str, Any]:
        """
        Collate a batch of features.

        Args:
            features: A list of features, where each feature is a dictionary containing:
                - input_ids: torch.Tensor of shape (n,)
                - attention_mask: torch.Tensor of shape (n,)
                - loss_mask: torch.Tensor of shape (n,)

        Returns:
            A dictionary containing:
                - input_ids: torch.Tensor of shape (B, N)
                - attention_mask: torch.Tensor of shape (B, N)
                - loss_mask: torch.Tensor of shape (B, N)
        """
        max_length = max(item["input_ids"].shape[1] for item in features)

        # pad for sequence parrel
        max_length = (
            (max_length + self.sp_degree - 1) // self.sp_degree
        ) * self.sp_degree
        # position max len, ulysses do not need chuck position ids
        position_max_len = max_length * self.ulysses_degree

        batch_input_ids = torch.cat(
            [self.paddingtensor2D(item["input_ids"], max_length) for item in features]
        )
        batch_attention_mask = torch.cat(
            [
                self.paddingtensor2D(item["attention_mask"], max_length)
                for item in features
            ]
        )
        if features[0]["loss_mask"].ndim == 3:
            batch_loss_mask = torch.cat(
                [self.paddingtensor(item["loss_mask"], max_length) for item in features]
            )
        else:
            batch_loss_mask = torch.cat(
                [
                    self.paddingtensor2D(item["loss_mask"], max_length)
                    for item in features
                ]
            )
        if "position_ids" in features[0]:
            if features[0]["position_ids"].ndim == 3:
                batch_position_ids = torch.cat(
                    [
                        self.padding_position_ids_3d(item["position_ids"], max_length)
                        for item in features
                    ],
                    dim=1,
                )
            else:
                batch_position_ids = torch.cat(
                    [
                        self.paddingtensor2D(item["position_ids"], position_max_len)
                        for item in features
                    ]
                )
        else:
            batch_position_ids = None
        batch = {
            "input_ids": batch_input_ids,
            "attention_mask": batch_attention_mask,
            "loss_mask": batch_loss_mask,
            "hidden_state": None,
            "target": None,
        }
        if batch_position_ids is not None:
            batch["position_ids"] = batch_position_ids
        if all("hidden_state" in item for item in features):
            assert all(
                "target" in item for item in features
            ), "target is required when hidden_state is provided"
            if self.sp_degree > 1:  # USP mode
                batch["hidden_state"] = torch.cat(
                    [item["hidden_state"] for item in features]
                )
            else:
                batch["hidden_state"] = torch.cat(
                    [
                        self.paddingtensor(item["hidden_state"], max_length)
                        for item in features
                    ]
                )
            batch["target"] = torch.cat(
                [self.paddingtensor(item["target"], max_length) for item in features]
            )
        return batch


# --- specforge/data/preprocessing.py
def list_local_files(path, suffixes=None):
    if suffixes is None:
        suffixes = [".ckpt", ".ckpt.gz"]
    datapaths = []
    for root, directories, files in os.walk(path):
        for file in files:
            file_path = os.path.join(root, file)
            datapaths.append(file_path)
    if suffixes:
        datapaths = [
            f_name
            for f_name in datapaths
            if any(f_name.endswith(suffix) for suffix in suffixes)
        ]
    datapaths.sort()  # Sort to ensure deterministic order across ranks
    return datapaths


def process_data(data, max_len, transform=None):
    new_data = {}
    # Squeeze due to our data generation script adding a batch dimension
    hidden_state = data["aux_hidden_state"].squeeze(0)[:max_len][None, :]
    target = data["hidden_state"].squeeze(0)[:max_len][None, :]

    input_ids = data["input_ids"][:max_len][None, :]
    loss_mask = data["loss_mask"][:max_len][None, :]
    loss_mask[0, -1] = 0

    new_data["attention_mask"] = torch.ones_like(loss_mask, dtype=torch.long)
    new_data["loss_mask"] = loss_mask
    new_data["target"] = target
    new_data["hidden_state"] = hidden_state
    new_data["input_ids"] = input_ids
    if transform:
        new_data = transform(new_data)
    return new_data
