"""Facts of the Hopper SM (sm_90a: H100, H200) that both backends' tile rules read.

Each number here is a property of the hardware or of PTX's ``wgmma`` instruction, not a tuning
choice; the backends' configs (``cute_moe/config.py``, ``triton_moe/config.py``) and the CuTe
kernels' compile functions (their grids: :func:`sm_count`) read them from this module and spell none
of them again.
"""

from __future__ import annotations

import functools

import torch

SMEM_PER_CTA_BYTES = 227 * 1024
"""Dynamic shared memory one CTA may opt in to on sm_90: 227 KiB = 232 448 B (of the SM's 228 KiB,
1 KiB stays reserved for the system)."""

WARPGROUP_THREADS = 128
"""Threads of one warpgroup (4 warps): the unit that issues a ``wgmma``."""

WGMMA_M = 64
"""Rows of A (and of the accumulator) one warpgroup's ``wgmma`` multiplies: always 64."""

WGMMA_N_STEP = 8
WGMMA_N_MAX = 256
"""A ``wgmma``'s N (columns of B and of the accumulator) is a multiple of 8 in [8, 256]."""

WGMMA_K_BYTES = 32
"""A ``wgmma``'s K spans 32 bytes of each operand row: K = 16 for bf16/fp16, 32 for fp8."""

TMA_ALIGN_BYTES = 16
"""TMA needs every row stride (and the base address) of a tensor to be a multiple of 16 bytes."""

H200_SM_COUNT = 132
"""SMs of an H200 (and of an H100 SXM): what :func:`sm_count` answers where there is no GPU."""


def wgmma_k(element_bytes: int) -> int:
    """K of one ``wgmma`` for operands of ``element_bytes`` bytes (16 for bf16, 32 for fp8)."""
    return WGMMA_K_BYTES // element_bytes


@functools.cache
def _device_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device=None) -> int:
    """SMs of the CUDA ``device`` (default: the current one), read from its properties.

    Without a CUDA device (CPU compilation, tests) this is :data:`H200_SM_COUNT`, 132: the
    machine the kernels are compiled for, not a measurement of this one.
    """
    if device is None:
        if not torch.cuda.is_available():
            return H200_SM_COUNT
        return _device_sms(torch.cuda.current_device())
    device = torch.device(device)
    if device.type != "cuda":
        return H200_SM_COUNT
    return _device_sms(device.index if device.index is not None else torch.cuda.current_device())
