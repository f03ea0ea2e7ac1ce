"""One dtype vocabulary for the whole package: ``"fp32"``, ``"bf16"``, ``"fp8_e4m3"``, ….

Printed graphs, decisions, kernel names, targets' rate tables and settings
all name dtypes with these strings (the same names precision formats use, so
``"bf16"`` means one thing everywhere). Convert with :func:`name` and
:func:`dtype`; no module keeps its own table.
"""

from __future__ import annotations

import torch

NAMES: dict[torch.dtype, str] = {
    torch.float64: "fp64",
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float8_e4m3fn: "fp8_e4m3",
    torch.float8_e5m2: "fp8_e5m2",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "b8",
    torch.complex64: "c64",
    torch.complex128: "c128",
}
DTYPES: dict[str, torch.dtype] = {v: k for k, v in NAMES.items()}

# Floating formats a matmul can compute in natively (GEMM rate tables are keyed by these).
FLOAT_NAMES = ("fp64", "fp32", "bf16", "fp16")


def name(dtype: torch.dtype) -> str:
    """``torch.float32`` → ``"fp32"``; a dtype outside the vocabulary keeps torch's own name."""
    return NAMES.get(dtype, str(dtype).replace("torch.", ""))


def dtype(text: str) -> torch.dtype:
    """``"bf16"`` → ``torch.bfloat16``; raises ValueError naming the accepted names."""
    try:
        return DTYPES[text]
    except KeyError:
        raise ValueError(f"unknown dtype name {text!r}; expected one of {sorted(DTYPES)}") from None


__all__ = ["DTYPES", "FLOAT_NAMES", "NAMES", "dtype", "name"]
