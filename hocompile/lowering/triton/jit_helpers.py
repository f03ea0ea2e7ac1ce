"""``@triton.jit`` helpers every generated kernel may call, defined once per generated module.

Kernels used to inline these at every use (three lines per rounding point,
a dozen per matmul kernel). A generator that calls one records its name in
``CodeWriter.helpers`` (``KernelSource.helpers``), and ``module.assemble``
writes each helper used once, above the kernels. Triton inlines them when
compiling, so the generated machine code is what the inlined text gave.

They are kept as source text rather than as functions of this module: a
``@triton.jit`` function is interpreted or compiled depending on
``TRITON_INTERPRET`` when it is *defined*, and the lowering sets that
variable only just before it loads a generated module; the generated file
also stays self-contained (readable, runnable on its own).
"""

from __future__ import annotations

from collections.abc import Iterable

ROUND_BF16 = "round_bf16"

# Round-to-nearest-even on the bits: Triton's interpreter truncates when it
# casts fp32 to bf16, and this is exact on GPUs too, so one code path is
# tested on CPU and run on GPU. NaN is kept (the carry could make it inf).
_SOURCES: dict[str, str] = {
    ROUND_BF16: "\n".join(
        [
            "@triton.jit",
            f"def {ROUND_BF16}(v):",
            '    """fp32 ``v`` rounded to the nearest bf16 (ties to even), still fp32; NaN stays NaN."""',
            "    bits = v.to(tl.uint32, bitcast=True)",
            "    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000",
            "    return tl.where(v != v, v, bits.to(tl.float32, bitcast=True))",
        ]
    ),
}


def helper_source(names: Iterable[str]) -> str:
    """The definitions of the helpers ``names``, each once, in a fixed order ("" for none)."""
    wanted = set(names)
    unknown = sorted(wanted - set(_SOURCES))
    if unknown:
        raise KeyError(f"unknown Triton helper(s) {unknown}; have {sorted(_SOURCES)}")
    return "\n\n\n".join(source for name, source in _SOURCES.items() if name in wanted)


__all__ = ["ROUND_BF16", "helper_source"]
