"""A stamped step's graph, split into one program per parameter class and one for the whole step.

The passes ran on the representatives' graph (classes/stamp.py): every node
belongs to one representative or to the step as a whole. Here each
representative's nodes become a graph of their own (its *class program*),
whose inputs are the member's tensors, the host scalars it reads and the
values of the shared part it reads; the shared part becomes the *global
program*, run once per step before the classes. Each is lowered like a whole
step (aten.py: write-backs, re-inplacing, direct kernel calls), and the
runtime runs a class's program once per member (runtime/stamped.py).

The inputs of a class program, in order: the representative's tensor inputs
(in the step's order), shared tensors (optimizer attributes, group tensors),
values of the global program, then host scalars.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from ..capture.finish import OutputAction
from ..capture.scalars import Expr
from ..capture.trace import CapturedStep
from ..classes.separable import GLOBAL, MemberId, Partition, expr_members, member_of_slot, partition
from ..classes.stamp import Stamp
from ..diskcache import DiskCache
from ..ir.decisions import decision_of
from ..ir.declined import Declined
from ..ir.graph import ROLE, InputSlot
from .aten import LoweredStep, cache_key, lower_to_aten
from .list_mode import ListModeError, contiguous, to_list_mode

# Temporaries one list-mode call may hold: its members' intermediate values are alive together
# (a per-member loop holds one member's). The bytes torch's own foreach AdamW keeps alive for
# a group of this size; past a few hundred members per call the Python overhead is gone anyway.
CHUNK_BYTES = 64 * 2**20


def temporaries_bytes(gm: fx.GraphModule) -> int:
    """Bytes of every value a program computes (its inputs excluded): a bound on what one member
    holds at once, registered ops' own workspace counted as one more copy of their output."""
    total = 0
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        vals = node.meta.get("val")
        for v in vals if isinstance(vals, (list, tuple)) else [vals]:
            if isinstance(v, torch.Tensor):
                size = v.numel() * v.element_size()
                total += 2 * size if getattr(node.target, "namespace", "") == "hocompile" else size
    return total


@dataclass(frozen=True)
class ProgramInput:
    """Where one input of a class (or the global) program comes from, per member.

    ``kind``: "member" (the member's own tensor: ``slot`` names the representative's),
    "shared" (a tensor of the optimizer or a group), "global" (output ``index`` of the
    global program), "scalar" (host scalar ``expr``, in the representative's names).
    """

    kind: str
    slot: InputSlot | None = None
    index: int = -1
    expr: Expr | None = None


@dataclass
class Program:
    """One lowered program: its graph (after the passes), where its inputs come from, its write-backs."""

    name: str  # "c3" or "global"
    member: MemberId  # the representative (GLOBAL for the global program)
    gm: fx.GraphModule
    inputs: list[ProgramInput]
    outputs: list[OutputAction]  # in the representative's slots
    exports: int = 0  # global program: how many leading outputs are values the classes read
    lowered: LoweredStep | None = field(default=None, repr=False)
    # Lowered over lists of members (list_mode.py): one call per class; else one call per member,
    # and ``list_mode_note`` says why.
    list_mode: bool = False
    list_mode_note: str = ""
    chunk: int = 1  # members per list-mode call (CHUNK_BYTES of temporaries at most)


def split_programs(
    captured: CapturedStep, gm: fx.GraphModule, stamp: Stamp
) -> tuple[Program, list[Program]] | Declined:
    """The global program and one program per class; or why the graph after the passes is no longer
    one program per member (a pass combined two classes' calls)."""
    part = partition(gm, captured.outputs)
    if part.problem:
        return Declined(part.problem)
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    values = list(output.args[0])
    global_nodes = part.nodes_of(gm, GLOBAL)
    exported = [
        n for n in global_nodes if any(part.owner.get(u) not in (GLOBAL, None) for u in n.users if u.op != "output")
    ]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    shared_writes = [(a, v) for a, v in zip(captured.outputs, values) if member_of_slot(a.slot) is None]
    global_program = _program(
        "global", GLOBAL, gm, part, placeholders, global_nodes, shared_writes, exported, {}
    )
    exports = {n: k for k, n in enumerate(exported)}
    programs = []
    for k, cls in enumerate(stamp.classes):
        member = (cls.group, cls.rep)
        writes = [(a, v) for a, v in zip(captured.outputs, values) if member_of_slot(a.slot) == member]
        nodes = part.nodes_of(gm, member)
        programs.append(_program(f"c{k}", member, gm, part, placeholders, nodes, writes, [], exports))
    return global_program, programs


def _program(
    name: str,
    member: MemberId,
    gm: fx.GraphModule,
    part: Partition,
    placeholders: list[fx.Node],
    nodes: list[fx.Node],
    writes: list[tuple[OutputAction, Any]],
    exported: list[fx.Node],
    exports: dict[fx.Node, int],
) -> Program:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs: list[ProgramInput] = []
    inside = set(nodes)
    needed = {a for n in nodes for a in n.all_input_nodes} | {v for _, v in writes if isinstance(v, fx.Node)}
    # Destinations of write-backs are inputs even when nothing reads them.
    written = {a.slot for a, _ in writes if a.mode == "copy"}

    def add(node: fx.Node, source: ProgramInput, role: Any) -> None:
        ph = graph.placeholder(node.name)
        ph.meta.update(node.meta)
        ph.meta[ROLE] = role
        env[node] = ph
        inputs.append(source)

    tensors = [n for n in placeholders if isinstance(n.meta.get(ROLE), InputSlot)]
    for node in tensors:  # the member's own tensors, then shared ones
        slot = node.meta[ROLE]
        if member_of_slot(slot) == member and (node in needed or slot in written):
            add(node, ProgramInput("member", slot), slot)
    for node in tensors:
        slot = node.meta[ROLE]
        if member_of_slot(slot) is None and (node in needed or slot in written):
            add(node, ProgramInput("shared", slot), slot)
    for node in [n for n in gm.graph.nodes if n in needed and n in exports and n not in inside]:
        add(node, ProgramInput("global", index=exports[node]), InputSlot.shared(exports[node]))
    for node in placeholders:
        role = node.meta.get(ROLE)
        if isinstance(role, Expr) and node in needed:
            add(node, ProgramInput("scalar", expr=role), role)
    for node in nodes:
        env[node] = graph.node_copy(node, lambda a: env[a])
    outs = [env[n] for n in exported] + [env[v] if isinstance(v, fx.Node) else v for _, v in writes]
    graph.output(tuple(outs))
    attrs = {str(n.target): getattr(gm, str(n.target)) for n in nodes if n.op == "get_attr"}
    program_gm = fx.GraphModule(attrs, graph)
    return Program(name, member, program_gm, inputs, [a for a, _ in writes], len(exported))


def member_stacks(program: Program) -> dict[str, int]:
    """Nodes stack-members decided to run on stacks of members (name -> members per stack); never
    one whose result the program writes back (a view of the stack's result would become state)."""
    stacks = {}
    for node in program.gm.graph.nodes:
        decision = decision_of(node, "stack-members") if node.op == "call_function" else None
        if decision is not None and decision.chose and not any(u.op == "output" for u in node.users):
            stacks[node.name] = int(decision.chose["stack"])  # type: ignore[arg-type]
    return stacks


def _list_transform(program: Program) -> Any:
    """The source rewrite that runs ``program`` over lists of its class's members (list_mode.py)."""
    member = [src.kind == "member" for src in program.inputs]
    per_member_scalar = [src.kind == "scalar" and src.expr is not None and bool(expr_members(src.expr))
                         for src in program.inputs]
    shared_scalar = [src.kind == "scalar" and not m for src, m in zip(program.inputs, per_member_scalar)]

    stacks = member_stacks(program)

    def transform(source: str, names: list[str]) -> str:
        pick = lambda flags: {n for n, f in zip(names, flags) if f}  # noqa: E731
        return to_list_mode(source, pick(member), pick(per_member_scalar), pick(shared_scalar), stacks)

    return transform


def lower_programs(
    programs: list[Program], identity: str, cache: DiskCache, header: str, fused_updates: bool, lists: bool = True
) -> str:
    """Lower each program with the aten lowering (class programs over lists of members where
    ``lists`` and list_mode.py can); returns the combined cache key."""
    keys = []
    for program in programs:
        index_of = {src.slot: i for i, src in enumerate(program.inputs) if src.kind in ("member", "shared")}
        copy_into: list[int | None] = [None] * program.exports
        copy_into += [index_of[a.slot] if a.mode == "copy" else None for a in program.outputs]
        key = cache_key(program.gm, f"{identity};program={program.name}")
        runs = "the part of the step every param shares" if program.member == GLOBAL else "run per member of its class"
        title = f"{header}\n# program {program.name}: {runs}"
        if lists and program.member != GLOBAL:
            program.chunk = max(1, CHUNK_BYTES // max(1, temporaries_bytes(program.gm)))
            stack = max(member_stacks(program).values(), default=1)  # whole stacks per list-mode call
            program.chunk = max(stack, program.chunk // stack * stack)
            try:
                program.lowered = lower_to_aten(
                    program.gm, key, cache, title + " (over lists of members)", copy_into, fused_updates,
                    transform=_list_transform(program), contiguous=contiguous,
                )
                program.list_mode = True
            except ListModeError as exc:
                program.list_mode_note = str(exc)
        if program.lowered is None:
            program.lowered = lower_to_aten(program.gm, key, cache, title, copy_into, fused_updates)
        keys.append(key)
    return keys[0] if len(keys) == 1 else cache_key_of(keys)


def cache_key_of(keys: list[str]) -> str:
    import hashlib

    return hashlib.sha256("\n".join(keys).encode()).hexdigest()
