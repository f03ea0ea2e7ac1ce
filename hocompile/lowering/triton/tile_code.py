"""Line emitters shared by the matmul kernel generators (matmul_kernels, fp8_kernels).

Each writes a few lines of Triton into a CodeWriter: tile index maths for
lower-triangle grids, masked loads and stores (a symmetric store writes a
tile and its mirror), the dot, casts and roundings, and the launcher. Kept
apart so each generator reads as its kernel's structure, not its plumbing.
"""

from __future__ import annotations

import torch

from ...ir import dtypes
from .code import TL_DTYPE, CodeWriter
from .code import emit_round as _round
from .tiles import TileConfig


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def header(w: CodeWriter, name: str, family: str, spec: object, origin: str, tile: TileConfig) -> None:
    w.line(f"# kernel {name}: family {family}; from {' '.join(origin.split())}")
    w.line(f"# spec: {spec!r}")
    w.line(
        f"# tile: BLOCK_M={tile.BLOCK_M} BLOCK_N={tile.BLOCK_N} BLOCK_K={tile.BLOCK_K} "
        f"num_warps={tile.num_warps} num_stages={tile.num_stages}"
    )


def lower_tile(w: CodeWriter) -> None:
    """Map ``pid`` to the lower-triangle tile (pid_i >= pid_j), row by row; rows_i, rows_j its rows and columns."""
    w.line("pid = tl.program_id(0)")
    w.line("batch = tl.program_id(1).to(tl.int64)")
    w.line("pid_i = ((tl.sqrt((8 * pid + 1).to(tl.float32)) - 1.0) * 0.5).to(tl.int32)")
    w.line("# the float square root may land one row off: fix it with exact integer tests")
    w.line("pid_i = tl.where(pid_i * (pid_i + 1) // 2 > pid, pid_i - 1, pid_i)")
    w.line("pid_i = tl.where((pid_i + 1) * (pid_i + 2) // 2 <= pid, pid_i + 1, pid_i)")
    w.line("pid_j = pid - pid_i * (pid_i + 1) // 2")
    w.line("rows_i = pid_i * BLOCK_M + tl.arange(0, BLOCK_M)")
    w.line("rows_j = pid_j * BLOCK_M + tl.arange(0, BLOCK_M)")


def upcast(w: CodeWriter, names: list[str], dtype: torch.dtype) -> None:
    """The interpreter computes half-precision dots wrongly: there, dot in fp32 (exact for these values)."""
    if dtype == torch.float32:
        return
    w.line("if UPCAST:")
    with w.indent():
        for var in names:
            w.line(f"{var} = {var}.to(tl.float32)")


def dot(w: CodeWriter, left: str, right: str, dtype: torch.dtype) -> None:
    # fp32 is true fp32 here; allowing TF32 is a later, separate precision decision.
    precision = ', input_precision="ieee"' if dtype == torch.float32 else ""
    w.line(f"acc = tl.dot({left}, {right}, acc{precision})")


def requantize(w: CodeWriter, var: str, stored: torch.dtype | None, dtype: torch.dtype) -> None:
    """An operand tile loaded from a tensor stored in ``stored`` becomes a ``dtype`` operand.

    Rounded once from its (exact) fp32 value to ``dtype``, as the emulation's
    ``quantize`` casts it; on GPU then cast to ``dtype`` (exact) for the dot.
    """
    if stored is None or stored == dtype:
        return
    w.line(f"# stored as {dtypes.name(stored)}: round to the {dtypes.name(dtype)} operand the tensor core sees")
    w.line(f"{var} = {var}.to(tl.float32)")
    _round(w, var, dtype)
    if dtype != torch.float32:
        w.line("if not UPCAST:")
        with w.indent():
            w.line(f"{var} = {var}.to({TL_DTYPE[dtype]})")


def cast(var: str, stored: torch.dtype) -> str:
    """``var`` (already rounded to ``stored``) as a value to store: the cast is exact."""
    return var if stored == torch.float32 else f"{var}.to({TL_DTYPE[stored]})"


def load(w: CodeWriter, var: str, base: str, rows: str, cols: str, ld: str, limits: tuple[str, str]) -> None:
    """``var = base[rows, cols]`` (row stride ``ld``), zero outside ``rows < limits[0]``, ``cols < limits[1]``."""
    w.line(f"{var}_mask = ({rows}[:, None] < {limits[0]}) & ({cols}[None, :] < {limits[1]})")
    w.line(f"{var} = tl.load({base} + {rows}[:, None] * {ld} + {cols}[None, :], mask={var}_mask, other=0.0)")


def store(w: CodeWriter, base: str, rows: str, cols: str, ld: str, value: str, mask: str) -> None:
    w.line(f"tl.store({base} + {rows}[:, None] * {ld} + {cols}[None, :], {value}, mask={mask})")


def store_symmetric(w: CodeWriter, base: str, ld: str, res: str, stored: torch.dtype) -> None:
    """Store the (i, j) tile and its mirror, so the result is exactly symmetric.

    Off the diagonal every row of tile i is below every row of tile j, so the
    triangle tests pass everywhere; a diagonal tile keeps its lower half and
    mirrors it (a dot need not be bitwise symmetric there).
    """
    w.line(f"lower = (rows_i[:, None] < {ld}) & (rows_j[None, :] <= rows_i[:, None])")
    store(w, base, "rows_i", "rows_j", ld, cast(res, stored), "lower")
    w.line(f"upper = (rows_i[None, :] < {ld}) & (rows_j[:, None] < rows_i[None, :])")
    store(w, base, "rows_j", "rows_i", ld, cast(f"tl.trans({res})", stored), "upper")


def wrapped(w: CodeWriter, items: list[str], width: int = 100) -> None:
    """``items`` as comma-terminated lines of at most about ``width`` characters."""
    line: list[str] = []
    for item in items:
        if line and len(", ".join(line + [item])) > width:
            w.line(", ".join(line) + ",")
            line = []
        line.append(item)
    if line:
        w.line(", ".join(line) + ",")


def signature(w: CodeWriter, name: str, args: list[str], consts: list[str]) -> None:
    w.line("@triton.jit")
    w.line(f"def {name}(")
    with w.indent():
        wrapped(w, args)
        wrapped(w, [f"{c}: tl.constexpr" for c in consts])
        w.line("UPCAST: tl.constexpr,  # interpreter: dot on fp32 copies of half-precision tiles")
    w.line("):")


def launcher(
    w: CodeWriter,
    name: str,
    params: str,
    grid: tuple[int, int],
    grid_note: str,
    args: list[str],
    consts: list[str],
    guard: str | None = None,
) -> None:
    w.line(f"def launch_{name}({params}):")
    with w.indent():
        if guard is not None:
            w.line(guard)
        w.line(f"grid = {grid}  # {grid_note}")
        w.line(f"{name}[grid](")
        with w.indent():
            wrapped(w, args)
            wrapped(w, consts)
        w.line(")")


def tile_consts(tile: TileConfig, square: bool, extra: tuple[str, ...] = ()) -> list[str]:
    blocks = [f"BLOCK_M={tile.BLOCK_M}"] + ([] if square else [f"BLOCK_N={tile.BLOCK_N}"])
    launch = ["UPCAST=upcast", f"num_warps={tile.num_warps}", f"num_stages={tile.num_stages}"]
    return blocks + [f"BLOCK_K={tile.BLOCK_K}", *extra] + launch


def lower_grid(spec_m: int, batch: int, tile: TileConfig) -> tuple[tuple[int, int], str]:
    tiles = cdiv(spec_m, tile.BLOCK_M)
    lower = tiles * (tiles + 1) // 2
    return (lower, batch), f"{lower} lower-triangle tiles of {tile.BLOCK_M}x{tile.BLOCK_M}, batch {batch}"


# ---------------------------------------------------------------- gram
