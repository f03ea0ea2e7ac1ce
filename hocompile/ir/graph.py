"""Graph conventions shared by capture, passes and lowering.

Every node hocompile touches carries a few ``node.meta`` keys:

- ``ORIGIN``: the pass that created the node ("capture" for traced nodes);
- ``ROLE``: for placeholders, what the input is (an :class:`InputSlot` for
  tensors, the :class:`~hocompile.capture.scalars.Expr` of a host scalar);
- ``"val"``: the fake tensor (or float for a host scalar) make_fx recorded.

:func:`print_graph` renders a graph for humans and expect tests: one line per
node, names normalised by role and order, dtype and shape, and the pass that
made the node; no ids, addresses or devices. Dtypes are spelled as
:mod:`hocompile.ir.dtypes` names them (``fp32[6, 4]``); a registered
``hocompile::`` op's arguments as its family's ``describe`` renders them
(:mod:`hocompile.ir.registry`), so the printer knows no op by name.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
import torch.fx as fx

from ..ops import newton_schulz_spec as ops_schema  # noqa: F401

# ops_schema: imported for its side effect, registering the built-in op families before any graph prints.
from . import dtypes
from .decisions import DECISION, decisions_of, render_choices
from .registry import OpFamily, families, family_of

ORIGIN = "hocompile.origin"
ROLE = "hocompile.role"
COMPILED_HELPER = "hocompile.compiled_helper"  # the name#digest a compiled_call node prints for its key
# DECISION (node.meta key of recorded Decisions) is declared in hocompile.ir.decisions, re-exported here.

# How a host scalar placeholder prints: a Python float is an fp64 on the host.
HOST_SCALAR = f"{dtypes.name(torch.float64)} (host)"


# The slot kinds that belong to one param (a member of a parameter class), not to its group or
# the optimizer: they are per member wherever classes, stacks and checks split a step by param.
PER_PARAM = ("param", "grad", "state", "pattr")


SlotKind = Literal["param", "grad", "state", "pattr", "attr", "group", "global", "graph", "carry"]


@dataclass(frozen=True)
class InputSlot:
    """Where a tensor input of the step graph lives in the optimizer: one subclass per kind.

    A slot is the key of every binding, guard and cache record, so it is a frozen value; two kinds
    never compare equal (each is its own class). Every kind has the same five fields, since code
    that walks a step's inputs reads them alike; each class declares which of (group, index, key)
    it uses, and the others must stay at their defaults (-1, ""), so one place is one key. Made by
    the constructors (``InputSlot.state(g, i, "exp_avg")``, ``slot.leaf_at(j, path)``).
    """

    kind: ClassVar[SlotKind]
    uses: ClassVar[tuple[bool, bool, bool]]  # (group, index, key)

    group: int = -1
    index: int = -1  # position in param_groups[group]["params"]
    key: str = ""  # a state key, an attribute's or a group entry's name
    # A tensor inside a container held there (containers.py): its index in flatten()'s
    # order, and its path for people (``[0]``, ``['L']``, ``.P``); -1: the value itself.
    leaf: int = -1
    path: str = ""

    def __post_init__(self) -> None:
        if type(self) is InputSlot:
            raise TypeError("InputSlot: make a slot of a kind (InputSlot.param(g, i), InputSlot.state(g, i, key), ...)")
        group, index, key = self.uses
        if (self.group >= 0) != group or (self.index >= 0) != index or (not key and self.key != ""):
            raise ValueError(f"InputSlot: a {self.kind!r} slot takes group={'a group' if group else -1}, "
                             f"index={'an index' if index else -1}{', a key' if key else ''}; got {self!r}")

    @staticmethod
    def param(group: int, index: int) -> InputSlot:
        return ParamSlot(group, index)

    @staticmethod
    def grad(group: int, index: int) -> InputSlot:
        return GradSlot(group, index)

    @staticmethod
    def state(group: int, index: int, key: str) -> InputSlot:
        return StateSlot(group, index, key)

    @staticmethod
    def param_attribute(group: int, index: int, name: str) -> InputSlot:
        return ParamAttributeSlot(group, index, name)

    @staticmethod
    def attribute(key: str) -> InputSlot:
        """A tensor attribute of the optimizer itself (``opt.key``)."""
        return AttributeSlot(key=key)

    @staticmethod
    def group_entry(group: int, key: str) -> InputSlot:
        return GroupSlot(group, key=key)

    @staticmethod
    def shared(index: int) -> InputSlot:
        """Value ``index`` of a stamped step's shared part, as its class programs take it."""
        return SharedSlot(index=index)

    @staticmethod
    def graph_input(index: int) -> InputSlot:
        return GraphInputSlot(index=index)

    @staticmethod
    def carry(read: int, j: int) -> InputSlot:
        """Value ``j`` the part of the step before host read ``read`` computed for the rest."""
        return CarrySlot(read, j, f"read{read}.{j}")

    def leaf_at(self, leaf: int, path: str) -> InputSlot:
        """Tensor ``leaf`` (``path`` for people) of the container this slot holds."""
        return type(self)(self.group, self.index, self.key, leaf, path)

    def whole(self) -> InputSlot:
        """The slot of the whole value (the container a leaf slot is in)."""
        return type(self)(self.group, self.index, self.key)

    def of_member(self, index: int) -> InputSlot:
        """The same place for the param at ``index`` of the same group (a class's other member)."""
        return type(self)(self.group, index, self.key)

    def label(self) -> str:
        if self.kind == "global":
            return f"shared{self.index}"
        if self.kind == "carry":
            return f"c_{_ident(self.key)}"
        if self.kind == "graph":
            return f"in{self.index}"
        inner = f"_l{self.leaf}" if self.leaf >= 0 else ""
        if self.kind == "attr":
            return f"a_{_ident(self.key)}{inner}"
        if self.kind == "group":
            return f"gt{self.group}_{_ident(self.key)}{inner}"
        base = {"param": "p", "grad": "g", "state": "s", "pattr": "pa"}[self.kind]
        suffix = f"_{_ident(self.key)}" if self.key else ""
        return f"{base}{self.group}_{self.index}{suffix}{inner}"

    def describe(self) -> str:
        if self.kind == "global":
            return f"value {self.index} of the part of the step every param shares"
        if self.kind == "graph":
            return f"input {self.index} of the graph torch.compile handed over"
        if self.kind == "carry":
            return f"value {self.index} computed before host read {self.group} ({self.key})"
        if self.kind == "attr":
            return f"optimizer attribute {self.key!r}{self.path}"
        if self.kind == "group":
            return f"param_groups[{self.group}][{self.key!r}]{self.path}"
        where = f"param_groups[{self.group}]['params'][{self.index}]"
        if self.kind == "param":
            return where
        if self.kind == "grad":
            return f"{where}.grad"
        if self.kind == "pattr":
            return f"{where}.{self.key}"
        return f"state[{where}][{self.key!r}]{self.path}"


# The kinds. Per param (a member of a parameter class): param, grad, state, pattr (PER_PARAM).
class ParamSlot(InputSlot):
    kind = "param"
    uses = (True, True, False)


class GradSlot(InputSlot):
    kind = "grad"
    uses = (True, True, False)


class StateSlot(InputSlot):
    kind = "state"
    uses = (True, True, True)


class ParamAttributeSlot(InputSlot):
    """A tensor attribute of a param, by name (Megatron's ``main_grad``)."""

    kind = "pattr"
    uses = (True, True, True)


class AttributeSlot(InputSlot):
    """A tensor attribute of the optimizer, by name."""

    kind = "attr"
    uses = (False, False, True)


class GroupSlot(InputSlot):
    """A tensor in ``param_groups[group][key]`` (``lr=torch.tensor(0.01)``)."""

    kind = "group"
    uses = (True, False, True)


class SharedSlot(InputSlot):
    """A stamped step's class program's input: value ``index`` of the step's shared part."""

    kind = "global"
    uses = (False, True, False)


class GraphInputSlot(InputSlot):
    """Input ``index`` of a graph torch.compile handed over (dynamo/graphs.py)."""

    kind = "graph"
    uses = (False, True, False)


class CarrySlot(InputSlot):
    """A value the part of the step before host read ``group`` computed (``key`` its name):
    host_reads.py hands it to the rest instead of computing it twice."""

    kind = "carry"
    uses = (True, True, True)


def _ident(text: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in text)


class GraphInvalid(AssertionError):
    """Raised by :func:`verify` when a pass left the graph malformed."""


def verify(gm: fx.GraphModule) -> None:
    """Check the invariants every pass must preserve.

    - FX lint (topological order, defined names, one output);
    - placeholders first, each with a ROLE;
    - no in-place aten op (the graph is functional; the runtime writes back);
    - every call node has an ORIGIN and a ``val``.
    """
    try:
        gm.graph.lint()
    except Exception as exc:  # fx raises plain RuntimeError with a good message
        raise GraphInvalid(f"fx lint failed: {exc}") from exc
    seen_body = False
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if seen_body:
                raise GraphInvalid(f"placeholder {node.name} after a body node")
            if ROLE not in node.meta:
                raise GraphInvalid(f"placeholder {node.name} has no {ROLE}")
            continue
        if node.op == "output":
            continue
        seen_body = True
        if node.op == "call_function":
            if ORIGIN not in node.meta:
                raise GraphInvalid(f"{node.format_node()} has no {ORIGIN}")
            if _is_inplace(node.target):
                raise GraphInvalid(f"in-place op left in the graph: {node.format_node()}")


# Ops that raise on their input's values (torch.linalg.LinAlgError), not only on shapes.
FALLIBLE: frozenset[str] = frozenset(
    {
        "aten::_linalg_eigh",
        "aten::linalg_eigh",
        "aten::_linalg_svd",
        "aten::linalg_svd",
        "aten::linalg_cholesky",
        "aten::linalg_cholesky_ex",
        "aten::linalg_inv",
        "aten::linalg_inv_ex",
        "aten::linalg_solve",
        "aten::_linalg_solve_ex",
        "aten::linalg_eig",
        "aten::linalg_eigvalsh",
        "aten::_linalg_check_errors",
    }
)


def is_fallible(node: fx.Node) -> bool:
    """An aten op in FALLIBLE, or a registered op whose family says it may raise on its data."""
    family = family_of(node)
    if family is not None:
        return family.fallible
    schema = getattr(node.target, "_schema", None)
    return node.op == "call_function" and schema is not None and schema.name in FALLIBLE


def _is_inplace(target: Any) -> bool:
    schema = getattr(target, "_schema", None)
    if schema is None:
        return False
    return any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


# --------------------------------------------------------------------- printing


def describe_value(val: Any) -> str:
    if isinstance(val, torch.Tensor):
        return f"{dtypes.name(val.dtype)}[{', '.join(str(int(s)) for s in val.shape)}]"
    if isinstance(val, float):
        return HOST_SCALAR
    if isinstance(val, (tuple, list)):
        return "(" + ", ".join(describe_value(v) for v in val) + ")"
    return type(val).__name__


def _target_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        ns = target.namespace
        name = target._schema.name.split("::")[-1]
        overload = target._overloadname
        return f"{ns}.{name}" + ("" if overload == "default" else f".{overload}")
    if target in (operator.getitem,):
        return "getitem"
    return getattr(target, "__name__", str(target))


def _format_arg(arg: Any, names: dict[fx.Node, str]) -> str:
    if isinstance(arg, fx.Node):
        return names[arg]
    if isinstance(arg, (list, tuple)):
        inner = ", ".join(_format_arg(a, names) for a in arg)
        return f"[{inner}]"
    if isinstance(arg, float):
        return repr(arg)
    if isinstance(arg, torch.dtype):
        return dtypes.name(arg)
    if isinstance(arg, torch.memory_format):
        return str(arg).replace("torch.", "")
    if isinstance(arg, torch.device):
        return "device"  # devices are not part of the printed contract
    return repr(arg)


def print_graph(gm: fx.GraphModule, title: str = "step", predictions: bool = True) -> str:
    """Render ``gm`` as stable, readable text (the expect-test format).

    ``predictions=False`` shows each recorded decision as its choices only
    (:meth:`~hocompile.ir.decisions.Decision.choices_key`): the cache key's text,
    so a recalibration that predicts other timings for the same plan keeps it.
    """
    names: dict[fx.Node, str] = {}
    lines: list[str] = []
    counter = 0
    scalars = 0
    inputs: list[str] = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            role = node.meta.get(ROLE)
            if isinstance(role, InputSlot):
                names[node] = role.label()
                inputs.append(f"  {names[node]}: {describe_value(node.meta.get('val'))}  # {role.describe()}")
            else:
                names[node] = f"h{scalars}"
                scalars += 1
                expr = getattr(role, "pretty", lambda: "?")()
                inputs.append(f"  {names[node]}: {HOST_SCALAR} = {expr}")
            continue
        if node.op == "output":
            outs = node.args[0]
            rendered = ", ".join(_format_arg(o, names) for o in outs)
            lines.append(f"  return ({rendered})")
            continue
        names[node] = f"t{counter}"
        counter += 1
        if node.op == "get_attr":
            value = getattr(gm, str(node.target))
            shown = repr(value.item()) if value.numel() == 1 else "..."
            lines.append(f"  {names[node]}: {describe_value(value)} = constant({shown})  # capture")
            continue
        family = family_of(node)
        if family is not None:  # a registered op prints its arguments by name, as its family describes them
            args = family.describe(family.spec_of(node), lambda value: _format_arg(value, names))
        else:
            args = [_format_arg(a, names) for a in node.args]
            args += [f"{k}={_format_arg(v, names)}" for k, v in node.kwargs.items()]
            if COMPILED_HELPER in node.meta:  # a torch.compile'd helper's op: its key by name and digest
                args[-1] = node.meta[COMPILED_HELPER]
        head = f"  {names[node]}: {describe_value(node.meta.get('val'))} = "
        call = f"{_target_name(node.target)}({', '.join(args)})"
        notes = [node.meta.get(ORIGIN, "?")]
        if DECISION in node.meta:
            notes.append(render_choices(node, predictions))
        lines.append(f"{head}{call}  # {'; '.join(notes)}")
    return "\n".join([f"graph {title}(", *inputs, "):", *lines]) + "\n"


def decisions(gm: fx.GraphModule) -> list[str]:
    """Recorded decisions, one line per distinct (op, input, decisions), with a count:
    ``hocompile.newton_schulz fp32[768, 3072]: choose-algorithm: gram fp32, ...``."""
    counts: dict[str, int] = {}
    for node in gm.graph.nodes:
        if not decisions_of(node):
            continue
        family = family_of(node)
        tensors = list(family.spec_of(node).tensors().values()) if family is not None else list(node.args)
        first = tensors[0] if tensors else None
        src = first.meta.get("val") if isinstance(first, fx.Node) else None
        line = f"{_target_name(node.target)} {describe_value(src)}: {render_choices(node)}"
        counts[line] = counts.get(line, 0) + 1
    return [line if n == 1 else f"{n} x {line}" for line, n in counts.items()]


def stat_key(family: OpFamily) -> str:
    """``graph_stats`` key of a family's call count: ``"newton-schulz"`` for ``newton_schulz``."""
    return family.name.replace("_", "-")


def graph_stats(gm: fx.GraphModule) -> dict[str, int]:
    """Counts shown by explain(): inputs by kind, body ops, and calls per registered op family.

    Every registered family has its key (zero when absent: explain() reads
    ``"newton-schulz"`` unconditionally); ``"hocompile ops"`` totals them.
    """
    stats = {"tensor inputs": 0, "host scalars": 0, "ops": 0, "matmuls": 0, "hocompile ops": 0}
    stats |= {stat_key(family): 0 for family in families()}
    matmuls = {"mm", "addmm", "bmm", "baddbmm", "matmul"}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            key = "tensor inputs" if isinstance(node.meta.get(ROLE), InputSlot) else "host scalars"
            stats[key] += 1
        elif node.op == "call_function":
            stats["ops"] += 1
            name = _target_name(node.target)
            if name.startswith("aten.") and name.split(".")[1] in matmuls:
                stats["matmuls"] += 1
            family = family_of(node)
            if family is not None:
                stats[stat_key(family)] = stats.get(stat_key(family), 0) + 1
                stats["hocompile ops"] += 1
    return stats


def stable_topological_sort(graph: fx.Graph) -> None:
    """Reorder so every node follows its inputs, otherwise keeping the order.

    Passes that create a node reading values from far apart (a stack over a
    whole shape group) insert it anywhere and let this fix the order.
    """
    placed: set[fx.Node] = set()
    order: list[fx.Node] = []
    output = next(n for n in graph.nodes if n.op == "output")
    for root in list(graph.nodes):
        if root is output or root in placed:
            continue
        stack: list[tuple[fx.Node, bool]] = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if node in placed:
                continue
            if expanded:
                placed.add(node)
                order.append(node)
                continue
            stack.append((node, True))
            for arg in reversed(node.all_input_nodes):
                if arg not in placed:
                    stack.append((arg, False))
    for node in order:
        output.prepend(node)
