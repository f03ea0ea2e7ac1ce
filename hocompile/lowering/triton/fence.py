"""The Triton step's write fence: nothing is written to params or state before every launch has run.

The aten lowering holds write-backs until the graph's last fallible op
(lowering/writeback.py). A Triton step is many launches, any of which can
raise (a kernel, an aten call such as eigh, a launcher's own check), so its
wrapper fences all of them: every value the step writes back lands in a
*stage* in the step's own buffers, and only after the last launch does one
*commit* copy the stages into their params and state. An error anywhere
before the commit leaves params and state bit for bit as they were, and a
``LinAlgError`` (eigh, SVD) can be answered by running that step eagerly,
as on aten (runtime/compiled_optimizer.py).

The commit is one generated kernel per element width (``writeback_i32``,
``writeback_i16``: the bits are copied, never reinterpreted as floats) whose
rows, ``(source, destination, numel)``, sit in the step's pointer table: it
is CUDA-graph safe, like the other table launches. A source the kernel
cannot take as flat memory (a transposed view, a tensor an aten call made)
is committed with ``copy_`` after it.

Memory: a stage lives from the launch that writes it until the commit. It
is placed in bytes of a step buffer no later launch touches (a Newton–Schulz
workspace, result or temporary whose group has finished:
:func:`place_stages`, first fit, with :class:`Liveness` over the emitted
launch text), and otherwise in one fresh ``fence`` arena. The wrapper runs
units that only produce write-backs (the update after Newton–Schulz, AdamW)
last, so their stages find dead buffers, and a write-back read on the way into
an op group (Muon's momentum) is recomputed by such a late unit
(recompute.py). GPT-2 small's Muon step then needs no new memory; a step with
no op group (AdamW alone) has nothing to reuse, and its arena is one copy of
what it writes. The step's explain() line ``write fence: ...`` gives the sizes.

Layouts: kernels index operands by address as row-major memory. The
generated ``forward`` therefore runs on contiguous copies of any strided
tensor input (:data:`HELPERS`' ``_dense_step``: the copies are written back
after the commit, so the fence still holds), and an operand an aten call
made inside the step is passed through ``_laid_out`` in the layout its
kernel reads (row-major, or the transpose of row-major), copied only when
it is not.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from .code import CodeWriter, KernelSource
from .tiles import pointwise_tile

ALIGN = 128  # bytes: every stage starts on a cache-line boundary
MAX_PROGRAMS = 1024  # commit programs per row; each loops over its row (grid-stride)
BLOCK = 1024  # words per program and iteration: a copy needs no smaller tile, even interpreted
WORD = {4: "tl.int32", 2: "tl.int16", 1: "tl.int8", 8: "tl.int64"}


@dataclass(frozen=True)
class Stage:
    """A written-back value's home until the commit: born at launch position ``born``."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    born: int

    @property
    def nbytes(self) -> int:
        count = 1
        for s in self.shape:
            count *= s
        return count * self.dtype.itemsize


@dataclass(frozen=True)
class Host:
    """A step buffer whose bytes stages may reuse after ``last_use`` (a launch position)."""

    name: str
    nbytes: int
    last_use: int


@dataclass(frozen=True)
class Placement:
    stage: Stage
    host: str  # a host buffer's name, or ARENA
    offset: int


ARENA = "fence"


@dataclass(frozen=True)
class FenceReport:
    """What the fence holds: ``staged`` bytes, of which ``reused`` sit in dead step buffers."""

    stages: int
    staged: int
    reused: int
    commits: int  # write-backs (rows and copy_ fallbacks)

    @property
    def fresh(self) -> int:
        return self.staged - self.reused

    def describe(self) -> str:
        mb = 2.0**20
        return (
            f"write fence: {self.commits} write-back(s) after every launch; {self.stages} staged "
            f"({self.staged / mb:.3f} MiB: {self.reused / mb:.3f} MiB in dead step buffers, "
            f"{self.fresh / mb:.3f} MiB new)"
        )


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def place_stages(stages: list[Stage], hosts: list[Host]) -> tuple[list[Placement], int]:
    """Each stage in the first host dead before it is born with room left (bump allocation: a
    stage keeps its bytes until the commit), else in the arena; and the arena's size."""
    used = {h.name: 0 for h in hosts}
    arena = 0
    placed: list[Placement] = []
    for stage in sorted(stages, key=lambda s: (s.born, s.name)):
        for host in hosts:
            start = _aligned(used[host.name])
            if host.last_use < stage.born and start + stage.nbytes <= host.nbytes:
                used[host.name] = start + stage.nbytes
                placed.append(Placement(stage, host.name, start))
                break
        else:
            start = _aligned(arena)
            arena = start + stage.nbytes
            placed.append(Placement(stage, ARENA, start))
    return placed, arena


_IDENT = re.compile(r"[A-Za-z_]\w*")


class Liveness:
    """The last launch position at which each host buffer (or a value aliasing it) is used.

    ``use(position, text, defines, view)``: the launch at ``position`` is
    ``text`` (its lines and table rows). An aten call's result ``defines``
    may share memory with whatever its arguments name, so later uses of it
    count as uses of those (conservative: any result, not only views);
    ``view`` says the call is an aliasing op, for :meth:`views_of`.
    """

    def __init__(self, names: set[str]) -> None:
        self.names = names  # host buffers and the step's inputs
        self.alias: dict[str, set[str]] = {}
        self.views: dict[str, set[str]] = {}
        self.last: dict[str, int] = {}

    def resolve(self, text: str) -> set[str]:
        """The names ``text``'s values may share memory with."""
        return self._resolve(text, self.alias)

    def views_of(self, text: str) -> set[str]:
        """The names ``text``'s values are views of (through aliasing ops only)."""
        return self._resolve(text, self.views)

    def _resolve(self, text: str, table: dict[str, set[str]]) -> set[str]:
        found: set[str] = set()
        for ident in _IDENT.findall(text):
            if ident in self.names:
                found.add(ident)
            found |= table.get(ident, set())
        return found

    def use(self, position: int, text: str, defines: str | None = None, view: bool = False) -> None:
        refs = self.resolve(text)
        for name in refs:
            self.last[name] = max(self.last.get(name, -1), position)
        if defines is not None:
            self.alias[defines] = refs
            self.views[defines] = self.views_of(text) if view else set()


def commit_kernel(itemsize: int, programs: int, arch: str) -> KernelSource:
    """The commit for ``itemsize``-byte elements: row ``(src, dst, numel)`` per program column."""
    word = WORD[itemsize]
    name = f"writeback_{word.split('.')[1]}_p{programs}"
    num_warps = pointwise_tile(arch).num_warps
    w = CodeWriter()
    w.line(f"# kernel {name}: family writeback; from the write fence (lowering/triton/fence.py)")
    w.line(f"# row = source, destination, numel; {itemsize}-byte words copied as bits")
    w.line(f"# tile BLOCK={BLOCK} num_warps={num_warps}; {programs} programs per row, grid-stride")
    w.line("@triton.jit")
    w.line(f"def {name}(ptrs, base, PROGRAMS: tl.constexpr, BLOCK: tl.constexpr):")
    with w.indent():
        w.line("row = ptrs + base + tl.program_id(1) * 3")
        w.line(f"src = tl.load(row).to(tl.pointer_type({word}))")
        w.line(f"dst = tl.load(row + 1).to(tl.pointer_type({word}))")
        w.line("n = tl.load(row + 2)")
        w.line("for start in range(tl.program_id(0).to(tl.int64) * BLOCK, n, PROGRAMS * BLOCK):")
        with w.indent():
            w.line("offs = start + tl.arange(0, BLOCK)")
            w.line("mask = offs < n")
            w.line("tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)")
    w.line()
    w.line()
    w.line(f"def launch_{name}(ptrs, base, members):")
    with w.indent():
        w.line(f"{name}[({programs}, members)](ptrs, base, PROGRAMS={programs}, BLOCK={BLOCK}, num_warps={num_warps})")
    tiling = {"BLOCK": BLOCK, "num_warps": num_warps}
    return KernelSource(name, "writeback", (itemsize, programs), "write fence", w.text(), tiling)


def commit_programs(max_numel: int) -> int:
    """Programs per row: enough to cover the largest write-back once, at most MAX_PROGRAMS."""
    return max(1, min(MAX_PROGRAMS, -(-max_numel // BLOCK)))


def stage_lines(stages: list[Stage], hosts: list[Host], commits: int) -> tuple[list[str], FenceReport]:
    """buffers()'s lines placing each stage (:func:`place_stages`), and what the fence holds."""
    placed, arena = place_stages(stages, hosts)
    last = {h.name: h.last_use for h in hosts}
    lines = ["# write fence: where each written-back value waits for the commit (fence.py)"] if placed else []
    if arena:
        lines.append(f"{ARENA} = torch.empty(({arena},), dtype=torch.uint8, device=dev)")
    for p in sorted(placed, key=lambda p: int(p.stage.name[2:])):
        s = p.stage
        where = "new bytes" if p.host == ARENA else f"{p.host} is dead after unit {last[p.host]}"
        lines.append(f"{s.name} = _carve({p.host}, {p.offset}, {s.shape}, {s.dtype})  # by unit {s.born}; {where}")
    reused = sum(p.stage.nbytes for p in placed if p.host != ARENA)
    return lines, FenceReport(len(stages), sum(s.nbytes for s in stages), reused, commits)


@dataclass(frozen=True)
class WriteBack:
    """One value to commit into input ``dest``: from row-major step memory at ``address`` (the
    kernel copies its bits), or, when ``address`` is None, with ``dest.copy_(source)``."""

    dest: str
    source: str
    address: str | None
    itemsize: int
    numel: int


@dataclass
class Commit:
    """The commit's launch lines, its pointer tables (label, header, rows) and kernels."""

    lines: list[str] = field(default_factory=list)
    tables: list[tuple[str, str, list[list[str]]]] = field(default_factory=list)
    kernels: list[KernelSource] = field(default_factory=list)
    launches: int = 0
    copies: int = 0  # aten copies: copy_ write-backs and snapshots (not CUDA-graph safe)
    summary: str = ""


def emit_commit(writes: list[WriteBack], liveness: Liveness, arch: str) -> Commit:
    """The commit: one kernel launch per element width for the table rows, then the ``copy_``s
    (a source that may be a view of an input written here is read first: a snapshot)."""
    commit = Commit(lines=["# write fence: every launch above has run; only now are params and state written"])
    rows: dict[int, list[WriteBack]] = {}
    for wb in writes:
        if wb.address is not None:
            rows.setdefault(wb.itemsize, []).append(wb)
    fallbacks = [wb for wb in writes if wb.address is None]
    dests = {wb.dest for wb in writes}
    sources: list[tuple[str, str]] = []
    for k, wb in enumerate(fallbacks):
        source = wb.source
        if liveness.views_of(source) & dests:
            commit.lines.append(f"snap{k} = {source}.clone()")
            commit.copies += 1
            source = f"snap{k}"
        sources.append((wb.dest, source))
    for itemsize in sorted(rows, reverse=True):
        group = rows[itemsize]
        kernel = commit_kernel(itemsize, commit_programs(max(wb.numel for wb in group)), arch)
        label = f"wb{itemsize * 8}"
        header = f"{label}: {kernel.name}, {len(group)} write-back(s) x [source, destination, numel]"
        table = [[wb.address or "", f"{wb.dest}.data_ptr()", str(wb.numel)] for wb in group]
        commit.tables.append((label, header, table))
        commit.kernels.append(kernel)
        commit.lines.append(f"{kernel.launcher}(ptrs, {label.upper()}, {len(group)})")
        commit.launches += 1
    for dest, source in sources:
        commit.lines.append(f"{dest}.copy_({source})")
        commit.copies += 1
        commit.launches += 1
    commit.summary = f"commit: {len(rows)} launch(es) from the pointer table" + (
        f", {len(fallbacks)} copy_" if fallbacks else ""
    )
    return commit


# Plain Python helpers of the generated module (written once, above buffers()).
HELPERS = '''\
def _carve(host, offset, shape, dtype):
    """A stage in ``host``'s bytes from ``offset``: no launch after the stage's own touches ``host``."""
    count = 1
    for s in shape:
        count *= s
    return host.view(-1).view(torch.uint8)[offset:offset + count * dtype.itemsize].view(dtype).view(shape)


def _laid_out(x, transposed):
    """``x`` in the layout its kernel reads it by (row-major, or the transpose of a row-major matrix)."""
    if transposed:
        return x if x.mT.is_contiguous() else x.mT.contiguous().mT
    return x if x.is_contiguous() else x.contiguous()


def all_dense(*args):
    """Every tensor argument is row-major: the kernels may index it by address."""
    return all(a.is_contiguous() for a in args if isinstance(a, torch.Tensor))


def _dense_step(step, self, args, written):
    """``step`` on contiguous copies of strided inputs; the copies of inputs it writes are copied back
    after its commit (a failed step has then written nothing)."""
    dense = [a.contiguous() if isinstance(a, torch.Tensor) else a for a in args]
    outputs = step(self, *dense)
    for i in written:
        if dense[i] is not args[i]:
            args[i].copy_(dense[i])
    return outputs
'''


__all__ = [
    "ARENA",
    "HELPERS",
    "Commit",
    "FenceReport",
    "Host",
    "Liveness",
    "Placement",
    "Stage",
    "WriteBack",
    "commit_kernel",
    "commit_programs",
    "emit_commit",
    "place_stages",
    "stage_lines",
]
