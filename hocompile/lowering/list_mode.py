"""One member's generated step, rewritten to run a whole parameter class per call.

A class program (class_programs.py) is lowered as one member's ``forward``;
this turns its source into a ``forward`` over lists, one entry per member,
so a class of 10,000 small matrices costs one Python call per op instead of
10,000::

    Before (one member)                          After (every member of the class)
    mul = p0_4.mul_(h0)                          torch._foreach_mul_(p0_4, h0); mul = p0_4
    sqrt = addcmul.sqrt()                        sqrt = torch._foreach_sqrt(addcmul)
    div = sqrt.div_(h9)                          torch._foreach_div_(sqrt, h9)       # h9: one value per member
    ns = hocompile_ops_newton_schulz(x, ...)     ns = [hocompile_ops_newton_schulz(m_x, ...) for m_x in x]

Why the values are bitwise the per-member code's: on CPU a ``torch._foreach_*``
op is a loop over its lists calling the very per-tensor op (ATen's slow path:
the fast, fused path exists for CUDA only), so only tensor methods with a
foreach twin on CPU tensors become foreach calls; every other statement runs
per member in a comprehension, in the member's own order. Arguments that are
the same for every member (host scalars of the whole step, shared values)
stay single values.
"""

from __future__ import annotations

import ast

import torch

# Tensor methods whose ``torch._foreach_<name>`` runs ``<name>`` per list entry on CPU,
# with the same arguments (lists where per member, numbers where shared).
FOREACH_METHODS = frozenset(
    {
        "add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_", "lerp", "lerp_",
        "addcmul", "addcmul_", "addcdiv", "addcdiv_", "sqrt", "sqrt_", "neg", "neg_", "abs", "abs_",
        "exp", "exp_", "reciprocal", "reciprocal_", "sign", "sign_", "zero_", "copy_",
        "maximum", "minimum", "clamp_min", "clamp_min_", "clamp_max", "clamp_max_", "rsqrt", "rsqrt_",
    }
)  # fmt: skip


class ListModeError(ValueError):
    """A statement this rewrite does not know how to run per member: the class runs member by member."""


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


class _Renamer(ast.NodeTransformer):
    def __init__(self, names: dict[str, str]) -> None:
        self.names = names

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if node.id in self.names and isinstance(node.ctx, ast.Load):
            return ast.copy_location(ast.Name(self.names[node.id], ast.Load()), node)
        return node


# The last parameter of a list-mode ``forward``: how many members the call runs (a statement
# that reads no member's value, a factory like ``zeros([])``, still makes one per member).
MEMBERS = "n_members"


def _per_member(expr: ast.expr, lists: set[str]) -> ast.expr:
    """``expr`` evaluated for each member: a comprehension over the lists it reads."""
    used = sorted(_names(expr) & lists)
    loop = {name: f"m_{name}" for name in used}
    body = _Renamer(loop).visit(ast.parse(ast.unparse(expr), mode="eval").body)
    target: ast.expr
    source: ast.expr
    if not used:
        target = ast.Name("_", ast.Store())
        source = ast.Call(ast.Name("range", ast.Load()), [ast.Name(MEMBERS, ast.Load())], [])
    elif len(used) == 1:
        target, source = ast.Name(loop[used[0]], ast.Store()), ast.Name(used[0], ast.Load())
    else:
        target = ast.Tuple([ast.Name(loop[n], ast.Store()) for n in used], ast.Store())
        source = ast.Call(ast.Name("zip", ast.Load()), [ast.Name(n, ast.Load()) for n in used], [])
    return ast.ListComp(body, [ast.comprehension(target, source, [], 0)])


def _foreach(
    call: ast.expr, tensors: set[str], numbers: set[str], member_numbers: set[str]
) -> tuple[str, ast.Call] | None:
    """``x.mul_(y)`` as ``torch._foreach_mul_(x, y)`` when every argument suits a foreach overload:
    tensor lists (per member), a number (shared: the Scalar overload) or a list of numbers (per
    member: the ScalarList overload, which takes it positionally, last)."""
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)):
        return None
    method, owner = call.func.attr, call.func.value
    if method not in FOREACH_METHODS or not (isinstance(owner, ast.Name) and owner.id in tensors):
        return None
    args, keywords = list(call.args), []
    for k in call.keywords:
        if k.arg == "value" and isinstance(k.value, ast.Name) and k.value.id in member_numbers:
            args.append(k.value)  # addcmul_(t1, t2, value=<per member>) -> _foreach_addcmul_(s, t1, t2, scalars)
        elif k.arg in ("value", "alpha"):
            keywords.append(k)
        else:
            return None
    for position, arg in enumerate(args):
        if isinstance(arg, ast.Name) and arg.id in member_numbers:
            if position != len(args) - 1:
                return None
            continue
        if isinstance(arg, ast.Name) and (arg.id in tensors or arg.id in numbers):
            continue
        if _number(arg):
            continue
        return None
    for k in keywords:
        if not (_number(k.value) or (isinstance(k.value, ast.Name) and k.value.id in numbers)):
            return None
        if any(isinstance(a, ast.Name) and a.id in member_numbers for a in args):
            return None  # the ScalarList overloads take no alpha/value besides their list
    func = ast.Attribute(ast.Name("torch", ast.Load()), f"_foreach_{method}", ast.Load())
    return owner.id, ast.Call(func, [ast.Name(owner.id, ast.Load()), *args], keywords)


def _number(arg: ast.expr) -> bool:
    if isinstance(arg, ast.UnaryOp) and isinstance(arg.op, ast.USub):
        arg = arg.operand
    return isinstance(arg, ast.Constant) and isinstance(arg.value, (int, float)) and not isinstance(arg.value, bool)


def _stacked(call: ast.expr, lists: set[str], k: int) -> ast.expr | None:
    """``f(x, a, b)`` over a list ``x`` of members as stacks of ``k``: ``f(torch.stack(chunk), a, b)``
    per chunk, its result unbound (passes/stack_members.py decided the stack computes the same bits)."""
    if not isinstance(call, ast.Call) or call.keywords or not call.args:
        return None
    first, rest = call.args[0], call.args[1:]
    if not (isinstance(first, ast.Name) and first.id in lists) or any(_names(a) & lists for a in rest):
        return None
    text = (
        f"[y for i in range(0, len({first.id}), {k}) for y in {ast.unparse(call.func)}"
        f"(torch.stack({first.id}[i:i + {k}]), {', '.join(ast.unparse(a) for a in rest)}).unbind(0)]"
    )
    return ast.parse(text, mode="eval").body


def to_list_mode(
    source: str,
    member_tensors: set[str],
    member_numbers: set[str],
    shared_numbers: set[str],
    stacks: dict[str, int] | None = None,
) -> str:
    """``source``'s ``forward`` over lists of members (see the module docstring).

    ``member_tensors``/``member_numbers``: the parameters that become lists (tensors; host
    scalars computed per member); ``shared_numbers``: host scalars the whole step shares;
    ``stacks``: values computed on stacks of members (name -> members per stack).
    The rewritten ``forward`` takes the member count last (``n_members``).
    Raises :class:`ListModeError` for a statement it cannot rewrite.
    """
    module = ast.parse(source)
    forward = next(n for n in module.body if isinstance(n, ast.FunctionDef) and n.name == "forward")
    tensors, numbers = set(member_tensors), set(shared_numbers)
    lists = set(member_tensors) | set(member_numbers)
    forward.args.args.append(ast.arg(MEMBERS))
    body: list[ast.stmt] = []
    for stmt in forward.body:
        if isinstance(stmt, ast.Return):
            body.append(stmt)
            continue
        if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Constant) and stmt.value.value is None:
            body.append(stmt)  # dropping references: lists like values
            continue
        # Every statement of a class program is the member's own (class_programs.py): one value each.
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            name = stmt.targets[0].id
            stacked = _stacked(stmt.value, lists, stacks[name]) if stacks and name in stacks else None
            if stacked is not None:
                body.append(ast.Assign([ast.Name(name, ast.Store())], stacked))
                tensors.add(name)
                lists.add(name)
                continue
            found = _foreach(stmt.value, tensors, numbers, set(member_numbers))
            if found is not None and found[1].func.attr.endswith("_"):  # type: ignore[attr-defined]
                owner, call = found  # in place: the foreach op returns nothing, the value is the list itself
                body.append(ast.Expr(call))
                body.append(ast.Assign([ast.Name(name, ast.Store())], ast.Name(owner, ast.Load())))
            elif found is not None:
                body.append(ast.Assign([ast.Name(name, ast.Store())], found[1]))
            else:
                body.append(ast.Assign([ast.Name(name, ast.Store())], _per_member(stmt.value, lists)))
            tensors.add(name)
            lists.add(name)
            continue
        if isinstance(stmt, ast.Expr):
            body.append(ast.Expr(_per_member(stmt.value, lists)))
            continue
        raise ListModeError(f"cannot run per member: {ast.unparse(stmt)}")
    forward.body = body
    return ast.unparse(ast.fix_missing_locations(module)) + "\n"


def contiguous(args: list[object]) -> bool:
    """Every tensor among ``args`` (lists of members included) is contiguous."""
    for a in args:
        if isinstance(a, torch.Tensor):
            if not a.is_contiguous():
                return False
        elif isinstance(a, list) and a and isinstance(a[0], torch.Tensor):
            if not all(map(torch.Tensor.is_contiguous, a)):
                return False
    return True
