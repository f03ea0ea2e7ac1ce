"""AdamW and SGD-momentum update chains -> torch's fused CPU kernels.

An fp32 AdamW step is memory-bound: eager's chain (mul_, lerp_, mul_,
addcmul_, sqrt, div_, add_, addcdiv_) passes over memory about 20 times per
element, torch's ``_fused_adamw_`` 7. Measured on GPT-2 small's 48 matrices
(benchmarks/results/adamw_step.md) the fused kernel is ~3-6x the eager
loop; the alternative, Inductor's C++ code generation, ran the same chain
about as fast but cost 2.4-4.4 s to import and 3-15 s to compile (warm/cold
cache) on this project's 2-core CPUs, against the issue's 1 s / 5 s
start-up bars. So the lowering recognises the chains here and calls the
fused kernels; everything else stays aten.

The graph carries derived host scalars (``h6 = -lr / (1 - beta1**step)``),
the kernels want the hyperparameters. :func:`adamw_update` recovers them
from the scalars and the (already incremented) step tensor, then checks the
scalars the kernel derives itself against the graph's; a mismatch (an
optimizer with the graph's shape but not AdamW's scalars) runs the graph's
own aten ops instead. The kernels' arithmetic is eager's up to rounding
(one pass, fused multiply-adds, ``1 - (1 - beta)`` recovered): params and
state stay within 1e-6 of eager (tests/test_fused_updates.py) but are not
bitwise -- measured 1e-9..6e-8 after two steps (AdamW's exp_avg_sq, SGD
with dampening or weight decay). The aten lowering is otherwise bitwise
eager for these optimizers (runtime/check/verify.py holds it to that), so this is
opt-in: ``HOCOMPILE_FUSED_UPDATES=1`` (settings.py).

    Before (one param)                             After
    t1 = mul(p, h0); t2 = lerp(m, g, h1)           adamw_update(p, g, m, v, step, h0, h1, ..., h6)
    t4 = addcmul(mul(v, h2), g, g, value=h3)
    t8 = addcdiv(t1, t2, add(div(sqrt(t4), h4), h5), value=h6)
    copy_(m, t2); copy_(v, t4); copy_(p, t8)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from ..ir.graph import ROLE, InputSlot

aten = torch.ops.aten
Number = int | float


def _host(x: Any) -> bool:
    """A host scalar: a Python number, or a placeholder that is not a tensor."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return True
    return isinstance(x, fx.Node) and x.op == "placeholder" and not isinstance(x.meta.get("val"), torch.Tensor)


def _call(x: Any, target: Any, nargs: int, kwargs: tuple[str, ...] = ()) -> bool:
    return (
        isinstance(x, fx.Node)
        and x.op == "call_function"
        and x.target is target
        and len(x.args) == nargs
        and set(x.kwargs) <= set(kwargs)
    )


def _fp32(*nodes: Any) -> bool:
    vals = [n.meta.get("val") if isinstance(n, fx.Node) else None for n in nodes]
    return all(isinstance(v, torch.Tensor) and v.dtype == torch.float32 and v.device.type == "cpu" for v in vals)


def adamw_update(
    p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: torch.Tensor,
    h_decay: Number | None, h_lerp: Number, h_beta2: Number, h_one_minus_beta2: Number,
    h_bc2_sqrt: Number, h_eps: Number, h_neg_step_size: Number,
) -> None:
    """One AdamW (or Adam without weight decay) update of ``p, m, v``; ``step`` already incremented."""
    beta1, beta2, eps = 1.0 - h_lerp, float(h_beta2), float(h_eps)
    n = float(step.item())
    bc1 = 1.0 - beta1**n
    lr = -h_neg_step_size * bc1
    decay = 0.0 if h_decay is None or lr == 0 else (1.0 - h_decay) / lr
    ok = (
        lr != 0
        and 0 <= beta2 < 1
        and math.isclose(h_one_minus_beta2, 1.0 - beta2, rel_tol=1e-12, abs_tol=1e-15)
        and math.isclose(h_bc2_sqrt, math.sqrt(1.0 - beta2**n), rel_tol=1e-9)
        and (h_decay is None or math.isclose(1.0 - lr * decay, h_decay, rel_tol=1e-12))
        and math.isclose(lr / bc1, -h_neg_step_size, rel_tol=1e-12)
    )
    if ok:
        torch._fused_adamw_(
            [p], [g], [m], [v], [], [step], lr=lr, beta1=beta1, beta2=beta2, weight_decay=decay, eps=eps,
            amsgrad=False, maximize=False,
        )
        return
    # Not AdamW's scalars: the graph's own ops (bitwise the unfused module).
    base = p if h_decay is None else aten.mul.Tensor(p, h_decay)
    new_m = aten.lerp.Scalar(m, g, h_lerp)
    new_v = aten.addcmul.default(aten.mul.Tensor(v, h_beta2), g, g, value=h_one_minus_beta2)
    denom = aten.add.Tensor(aten.div.Tensor(aten.sqrt.default(new_v), h_bc2_sqrt), h_eps)
    new_p = aten.addcdiv.default(base, new_m, denom, value=h_neg_step_size)
    m.copy_(new_m)
    v.copy_(new_v)
    p.copy_(new_p)


def sgd_update(
    p: torch.Tensor, g: torch.Tensor, buf: torch.Tensor, h_decay: Number | None, h_momentum: Number,
    h_dampened: Number | None, h_nesterov: Number | None, h_neg_lr: Number,
) -> None:
    """One SGD-momentum update of ``p, buf`` (the buffer exists: not the first step)."""
    if h_nesterov is None or h_nesterov == h_momentum:
        torch._fused_sgd_(
            [p], [g], [buf], weight_decay=0.0 if h_decay is None else float(h_decay), momentum=float(h_momentum),
            lr=-float(h_neg_lr), dampening=0.0 if h_dampened is None else 1.0 - h_dampened,
            nesterov=h_nesterov is not None, maximize=False, is_first_step=False,
        )
        return
    d = g if h_decay is None else aten.add.Tensor(g, p, alpha=h_decay)
    scaled = aten.mul.Tensor(buf, h_momentum)
    new_buf = aten.add.Tensor(scaled, d) if h_dampened is None else aten.add.Tensor(scaled, d, alpha=h_dampened)
    u = aten.add.Tensor(d, new_buf, alpha=h_nesterov)
    new_p = aten.add.Tensor(p, u, alpha=h_neg_lr)
    buf.copy_(new_buf)
    p.copy_(new_p)


class _Writebacks:
    """The graph's write-back ``copy_`` nodes by destination, and node order."""

    def __init__(self, graph: fx.Graph) -> None:
        self.graph = graph
        self.copy_of: dict[fx.Node, fx.Node] = {}
        for n in graph.nodes:
            if n.meta.get("hocompile.origin") == "writeback" and isinstance(n.args[0], fx.Node):
                self.copy_of[n.args[0]] = n
        self.order = {n: i for i, n in enumerate(graph.nodes)}

    def value_into(self, dest: Any, value: fx.Node) -> fx.Node | None:
        """The copy_ writing ``value`` into placeholder ``dest``, if that is what happens."""
        copy = self.copy_of.get(dest) if isinstance(dest, fx.Node) and dest.op == "placeholder" else None
        return copy if copy is not None and copy.args[1] is value else None

    def step_of(self, p: fx.Node) -> fx.Node | None:
        slot = p.meta.get(ROLE)
        if not isinstance(slot, InputSlot):
            return None
        for dest, copy in self.copy_of.items():
            other = dest.meta.get(ROLE)
            if isinstance(other, InputSlot) and (other.kind, other.group, other.index, other.key) == (
                "state", slot.group, slot.index, "step"
            ):
                val = dest.meta.get("val")
                ok = isinstance(val, torch.Tensor) and val.dim() == 0 and val.dtype == torch.float32
                return copy if ok else None
        return None


def _only_users(node: fx.Node, allowed: set[fx.Node]) -> bool:
    return set(node.users) <= allowed


def _match_adamw(w: _Writebacks, p: fx.Node, copy_p: fx.Node) -> tuple[list[fx.Node], list[Any]] | None:
    new_p: Any = copy_p.args[1]  # Any: fx arguments are checked node by node below
    if not _call(new_p, aten.addcdiv.default, 3, ("value",)) or not _host(new_p.kwargs.get("value")):
        return None
    base, new_m, denom = new_p.args
    decay = None
    if base is not p:
        if not (_call(base, aten.mul.Tensor, 2) and base.args[0] is p and _host(base.args[1])):
            return None
        decay = base.args[1]
    if not (_call(new_m, aten.lerp.Scalar, 3) and _host(new_m.args[2])):
        return None
    m, g = new_m.args[0], new_m.args[1]
    if not (_call(denom, aten.add.Tensor, 2) and _host(denom.args[1]) and _call(denom.args[0], aten.div.Tensor, 2)):
        return None
    div = denom.args[0]
    sqrt, h_bc2 = div.args
    if not (_host(h_bc2) and _call(sqrt, aten.sqrt.default, 1) and _call(sqrt.args[0], aten.addcmul.default, 3,
                                                                          ("value",))):
        return None
    new_v = sqrt.args[0]
    scaled, g1, g2 = new_v.args
    if not (g1 is g and g2 is g and _host(new_v.kwargs.get("value")) and _call(scaled, aten.mul.Tensor, 2)):
        return None
    v, h_beta2 = scaled.args
    copy_m, copy_v, copy_step = w.value_into(m, new_m), w.value_into(v, new_v), w.step_of(p)
    if copy_m is None or copy_v is None or copy_step is None or not _host(h_beta2):
        return None
    if not (isinstance(g, fx.Node) and g.op == "placeholder" and g not in w.copy_of and _fp32(p, g, m, v)):
        return None
    inner = [n for n in (base, scaled, sqrt, div, denom) if n is not p]
    uses = {
        **{n: {new_p} for n in inner if n in (base, denom)},
        scaled: {new_v}, sqrt: {div}, div: {denom}, new_m: {new_p, copy_m}, new_v: {sqrt, copy_v}, new_p: {copy_p},
    }
    if not all(_only_users(n, allowed) for n, allowed in uses.items()):
        return None
    # The kernel reads the incremented step: the value written back, not the state tensor (whose
    # write-back stays where it is and can itself be computed in place).
    step = copy_step.args[1]
    if not (isinstance(step, fx.Node) and isinstance(step.meta.get("val"), torch.Tensor)):
        return None
    nodes = [copy_p, copy_m, copy_v, new_p, denom, div, sqrt, new_v, scaled, new_m, *([base] if base is not p else [])]
    h = [decay, new_m.args[2], h_beta2, new_v.kwargs["value"], h_bc2, denom.args[1], new_p.kwargs["value"]]
    return nodes, [p, g, m, v, step, *h]


def _match_sgd(w: _Writebacks, p: fx.Node, copy_p: fx.Node) -> tuple[list[fx.Node], list[Any]] | None:
    new_p: Any = copy_p.args[1]  # Any: fx arguments are checked node by node below
    if not (_call(new_p, aten.add.Tensor, 2, ("alpha",)) and new_p.args[0] is p and _host(new_p.kwargs.get("alpha"))):
        return None
    u = new_p.args[1]
    nesterov: Any = None
    new_buf = u
    if _call(u, aten.add.Tensor, 2, ("alpha",)) and not _call(u.args[0], aten.mul.Tensor, 2):
        nesterov, new_buf = u.kwargs.get("alpha"), u.args[1]  # grad.add(buf, alpha=momentum)
        if not _host(nesterov):
            return None
    if not (_call(new_buf, aten.add.Tensor, 2, ("alpha",)) and _call(new_buf.args[0], aten.mul.Tensor, 2)):
        return None
    scaled, d = new_buf.args
    dampened = new_buf.kwargs.get("alpha")
    buf, momentum = scaled.args
    if (dampened is not None and not _host(dampened)) or not _host(momentum):
        return None
    if nesterov is not None and u.args[0] is not d:
        return None
    decay, g = None, d
    if _call(d, aten.add.Tensor, 2, ("alpha",)) and d.args[1] is p and _host(d.kwargs.get("alpha")):
        decay, g = d.kwargs.get("alpha"), d.args[0]
    copy_buf = w.value_into(buf, new_buf)
    if copy_buf is None or not (isinstance(g, fx.Node) and g.op == "placeholder" and g not in w.copy_of):
        return None
    if not _fp32(p, g, buf):
        return None
    readers_u = {u} if nesterov is not None else set()
    uses: dict[fx.Node, set[fx.Node]] = {scaled: {new_buf}, new_buf: {copy_buf, new_p, *readers_u}, new_p: {copy_p}}
    if nesterov is not None:
        uses[u] = {new_p}
    if decay is not None:
        uses[d] = {new_buf, *readers_u}
    if not all(_only_users(n, allowed) for n, allowed in uses.items()):
        return None
    nodes = [copy_p, copy_buf, new_p, *([u] if nesterov is not None else []), new_buf, scaled]
    nodes += [d] if decay is not None else []
    return nodes, [p, g, buf, decay, momentum, dampened, nesterov, new_p.kwargs["alpha"]]


_MATCHERS: tuple[tuple[str, Callable[..., Any], Callable[..., None]], ...] = (
    ("adamw", _match_adamw, adamw_update),
    ("sgd", _match_sgd, sgd_update),
)


def fuse_updates(graph: fx.Graph) -> list[str]:
    """Replace recognised AdamW / SGD-momentum chains by one fused-kernel call each; ``kind:param`` per match."""
    done: list[str] = []
    w = _Writebacks(graph)
    for p, copy_p in list(w.copy_of.items()):
        if w.copy_of.get(p) is not copy_p:
            continue
        slot = p.meta.get(ROLE)
        if not (isinstance(slot, InputSlot) and slot.kind == "param" and isinstance(copy_p.args[1], fx.Node)):
            continue
        for kind, match, update in _MATCHERS:
            found = match(w, p, copy_p)
            if found is None:
                continue
            nodes, args = found
            anchor = max((n for n in nodes if n.meta.get("hocompile.origin") == "writeback"), key=w.order.__getitem__)
            inputs = [a for a in args if isinstance(a, fx.Node)]
            if any(w.order[a] > w.order[anchor] for a in inputs):
                continue  # an input (the step's new value) computed after the last write-back: not here
            with graph.inserting_after(anchor):
                call = graph.call_function(update, tuple(args))
            call.meta["hocompile.origin"] = f"fused-{kind}"
            for n in nodes:  # writebacks first, then values from consumers to producers
                graph.erase_node(n)
            w.copy_of = {d: c for d, c in w.copy_of.items() if c not in nodes}
            w.order = {n: i for i, n in enumerate(graph.nodes)}
            done.append(f"{kind}:{p.name}")
            break
    return done
