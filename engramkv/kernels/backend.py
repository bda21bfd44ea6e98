"""Which implementation a kernel call runs: the Triton kernel or its PyTorch twin.

`ModelConfig.kernels` chooses: "auto" runs Triton on CUDA tensors when Triton is installed and the twin
everywhere else; "torch" always runs the twin; "triton" always runs the kernel and fails where it cannot
(no Triton, or a CPU tensor without TRITON_INTERPRET=1, Triton's interpreter, which the CPU tests use).
A kernel may still take its twin for a shape it was not written for (say so where it does).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Literal

import torch

from engramkv.errors import ConfigError

Backend = Literal["auto", "triton", "torch"]


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Triton's interpreter is on: kernels run (slowly) on CPU tensors. Read when a kernel module is imported."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(backend: Backend, device: torch.device) -> bool:
    if backend == "torch":
        return False
    runnable = triton_installed() and (device.type == "cuda" or interpreting())
    if backend == "auto":
        return runnable and device.type == "cuda"
    if not runnable:
        why = "Triton is not installed (pip install triton)" if not triton_installed() else (
            f"tensors are on {device.type}, and Triton runs on CUDA (or on the CPU under TRITON_INTERPRET=1)")
        raise ConfigError(f"model.kernels='triton', but {why}; use 'auto' or 'torch'")
    return True
