"""GPU detection and the Blackwell profile ``hsdump serve`` applies (see docs/image.md).

Every setting was checked against the SGLang 0.5.23 source; the user overrides any of them by
passing the same SGLang flag after ``--`` (or turns the profile off with ``--profile none``).
"""

from __future__ import annotations

import glob
import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROFILES = ("auto", "sm120", "sm100", "none")


@dataclass(frozen=True)
class Setting:
    """One SGLang flag of a profile: the ServerArgs field it sets, its CLI form, and why."""

    dest: str
    args: tuple[str, ...]
    why: str


def detect_compute_capability() -> tuple[int, int] | None:
    """Return the lowest compute capability among the visible GPUs, or None without a GPU.

    Asks ``nvidia-smi`` first; falls back to torch in a child process when NVIDIA device nodes
    exist, so this process never holds a CUDA context (it is replaced by the server right after).
    """
    caps: list[tuple[int, int]] = []
    if shutil.which("nvidia-smi"):
        r = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=60, check=False)
        if r.returncode == 0:
            caps = [_parse_cap(line) for line in r.stdout.split() if line.strip()]
    if not caps and glob.glob("/dev/nvidia[0-9]*"):  # no device node: no GPU, skip torch
        code = ("import torch\n"
                "for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):\n"
                "    print('%d.%d' % torch.cuda.get_device_capability(i))")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=120, check=False)
        if r.returncode == 0:
            caps = [_parse_cap(line) for line in r.stdout.split()]
    return min(caps) if caps else None


def _parse_cap(text: str) -> tuple[int, int]:
    major, _, minor = text.strip().partition(".")
    return int(major), int(minor or 0)


def profile_for(capability: tuple[int, int] | None) -> str:
    """Map a compute capability to a profile name (``none`` off Blackwell or without a GPU)."""
    if capability is None:
        return "none"
    return {12: "sm120", 10: "sm100"}.get(capability[0], "none")


def read_model_config(model_path: str) -> dict[str, Any]:
    """Return the model's ``config.json`` when ``model_path`` is a local directory, else {}."""
    path = Path(model_path) / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _quant_method(config: dict[str, Any]) -> str:
    quant = config.get("quantization_config") or {}
    text_config = config.get("text_config") or {}  # Kimi-K2.5 nests the language model
    quant = quant or text_config.get("quantization_config") or {}
    return str(quant.get("quant_method", "")).lower()


def _is_plain_mla(config: dict[str, Any]) -> bool:
    """DeepSeek-V2/V3-style MLA without DSA sparse attention (which needs its own backend)."""
    cfg = config.get("text_config") or config
    return "kv_lora_rank" in cfg and "index_topk" not in cfg


def profile_settings(profile: str, config: dict[str, Any], tp: int) -> list[Setting]:
    """Return the settings of ``profile`` for a model with ``config`` served at ``tp`` GPUs."""
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; choose one of {', '.join(PROFILES)}")
    settings: list[Setting] = []
    if profile != "sm120":
        # sm100: 0.5.23's automatic choices target B200 already (trtllm_mla for DeepSeek-V3,
        # trtllm_mha for MHA models, DeepGEMM FP8), so the profile adds nothing there.
        return settings
    if _is_plain_mla(config):
        settings.append(Setting(
            "attention_backend", ("--attention-backend", "triton"),
            "MLA on sm_120: 0.5.23 picks trtllm_mla only on sm100 and FA3 only on Hopper, "
            "else triton (get_default_attn_backend); explicit, since earlier releases chose "
            "trtllm_mla here and failed with 'Unsupported architecture' (sglang #24633)"))
    if _quant_method(config) == "fp8":
        settings.append(Setting(
            "fp8_gemm_runner_backend", ("--fp8-gemm-backend", "triton"),
            "block-FP8 GEMM on sm_120: the Triton kernel is the one reported to work on "
            "RTX PRO 6000 (DeepGEMM and CUTLASS FP8 crashed, sglang #18870)"))
        settings.append(Setting(
            "moe_runner_backend", ("--moe-runner-backend", "triton"),
            "FP8 MoE on sm_120: Triton fused MoE (101 KB shared memory configs, PR #9251) "
            "instead of DeepGEMM"))
    if tp > 1:
        settings.append(Setting(
            "disable_custom_all_reduce", ("--disable-custom-all-reduce",),
            "sm_120 boards are PCIe-only: custom all-reduce relies on P2P, which hangs behind "
            "IOMMU/ACS (NCCL #1999); 0.5.23 already skips it above 2 PCIe GPUs"))
    return settings
