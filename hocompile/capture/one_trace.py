"""One trace of an optimizer's step: the optimizer's own objects rebound to fakes, its step run, put back.

:func:`trace_once` is what ``make_fx`` runs (``trace.py`` calls it twice, with different sentinel
payloads, and more often while it finds Python numbers the step rewrites). A trace is a
:class:`_StepTrace`, in named steps that share its state:

1. ``install``: the fakes go where the step reads its tensors: the group and attribute tensors
   (0-d ones become host counters) and containers of tensors (copies holding fakes); then, from
   where everything is put back whatever happens, the params (each with its grad and its
   stand-in attributes) and their state;
2. ``run``: the optimizer's own ``step``, under the host-scalar mode, with its torch.compile'd
   helpers as opaque ops where they are kept whole;
3. ``put_back`` (also when the step raised): every group value, attribute and the state as they
   were, noting what the step changed (host changes; tensors and containers it assigned);
4. ``state_writes``: the state tensors the step assigned or rewrote, in its own insertion order.

Nothing here touches real data, and nothing rebound stays rebound.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from ..distributed.sharded import global_fakes, is_dtensor
from ..errors import CaptureError
from ..ir.graph import InputSlot
from . import stand_ins
from .collectives import traced_collectives
from .compiled_helpers import opaque_compiled_helpers
from .container_trace import ContainerTrace, TreeWrite, container_attributes
from .containers import holds_tensors
from .group_hypers import counter_name, restore_groups, swap_in_hyperparams
from .host_reads import TraceReads
from .host_scalars import HostScalarMode
from .host_state import MISSING, Change, HostSlot
from .hyper_params import HyperParam, ScalarTracker, sentinel
from .scalars import input_expr
from .slots import TraceView, group_containers, slot_tensor
from .snapshot import Snapshot
from .tracing_errors import tracing_error


@dataclass(frozen=True)
class CounterRead:
    """A 0-d state tensor whose value the step reads on the host."""

    name: str
    slot: InputSlot


@dataclass
class TraceResult:
    gm: fx.GraphModule
    tracker: ScalarTracker
    assigns: list[InputSlot]
    clears: list[tuple[int, int]]
    changes: list[Change]
    counters: list[CounterRead]
    matmul_precisions: list[str]
    fused_kernels: list[str] = field(default_factory=list)
    trees: list[TreeWrite] = field(default_factory=list)
    reads: TraceReads | None = None


def unwrapped_step(opt: torch.optim.Optimizer) -> Any:
    # Optimizer patches `step` with a hook-running wrapper; the runtime runs the
    # hooks itself around the compiled step, so the trace must not run them.
    step = type(opt).step
    return getattr(step, "__wrapped__", step) if getattr(step, "hooked", False) else step


def _dynamo_config_patch(**changes: Any) -> Any:
    import torch._dynamo

    return torch._dynamo.config.patch(**changes)


def trace_once(
    opt: torch.optim.Optimizer,
    slots: list[InputSlot],
    structural: frozenset[str],
    salt: int,
    lifted: frozenset[HostSlot] = frozenset(),
    view: TraceView | None = None,
    opaque: bool = False,
    traced_helpers: dict[str, str] | None = None,
) -> TraceResult:
    """``opt``'s step traced on fakes of ``slots`` (sentinel payloads ``salt``), ``lifted`` Python numbers
    as host inputs; ``view``: only these params of each group; ``opaque``: every torch.compile'd helper
    kept whole (else those that multiply matrices are traced through, and named in ``traced_helpers``)."""
    trace = _StepTrace(opt, slots, structural, salt, lifted, view, opaque, traced_helpers)
    try:
        # A helper wrapped in torch.compile (an NS function, an Adam update)
        # runs as plain Python inside our trace instead of refusing it.
        with _dynamo_config_patch(error_on_nested_fx_trace=False), traced_collectives():
            gm = make_fx(torch.func.functionalize(trace), tracing_mode="fake")(*trace.real_inputs)
    except CaptureError:
        raise
    except Exception as exc:
        raise tracing_error(opt, exc, lifted) from exc
    return TraceResult(
        gm, trace.tracker, trace.assigns, trace.clears, trace.changes, trace.counters,
        sorted(trace.mode.matmul_precisions), sorted(trace.mode.fused_kernels), trace.boxes.trees, trace.reads,
    )


class _StepTrace:
    """The state one trace's steps share; calling it (``make_fx`` does) runs them in order."""

    def __init__(
        self,
        opt: torch.optim.Optimizer,
        slots: list[InputSlot],
        structural: frozenset[str],
        salt: int,
        lifted: frozenset[HostSlot],
        view: TraceView | None,
        opaque: bool,
        traced_helpers: dict[str, str] | None,
    ) -> None:
        self.opt, self.slots, self.structural, self.salt, self.lifted = opt, slots, structural, salt, lifted
        self.view, self.opaque, self.traced_helpers = view, opaque, traced_helpers
        self.tracker = ScalarTracker(real={}, salt=salt)
        self.mode = HostScalarMode(self.tracker, salt)
        self.real_inputs = [slot_tensor(opt, s) for s in slots]
        self.reads = TraceReads(self.real_inputs)
        if any(is_dtensor(t) for t in self.real_inputs):
            self.real_inputs = global_fakes(self.real_inputs)  # DTensors: the step eager runs sees global shapes
        else:
            self.mode.reader = self.reads  # data-dependent host reads split the step (host_reads.py); not DTensors'
        self.step = unwrapped_step(opt)
        # Filled by the steps below.
        self.counters: list[CounterRead] = []
        self.assigns: list[InputSlot] = []
        self.clears: list[tuple[int, int]] = []
        self.changes: list[Change] = []
        self.attr_assigns: list[InputSlot] = []
        self.attr_values: list[torch.Tensor] = []
        self.fake_state: defaultdict[Any, dict[str, Any]] = defaultdict(dict)
        self.installed_state: dict[tuple[int, int], dict[str, Any]] = {}
        self.fakes: dict[tuple[int, int], torch.Tensor] = {}
        self.param_attrs: dict[tuple[int, int], tuple[torch.Tensor, dict[str, Any]]] = {}
        self.boxed_groups: list[tuple[int, str]] = []

    def __call__(self, *flat: torch.Tensor) -> list[torch.Tensor]:
        opt = self.opt
        self.by_slot = dict(zip(self.slots, flat))
        self.reachable = Snapshot(opt, skip=set())
        self.saved_state = opt.state
        self.saved_attrs = dict(vars(opt))
        self.saved_groups = swap_in_hyperparams(opt.param_groups, self.structural, self.tracker, self.salt)
        lifted = sorted(self.lifted, key=repr)
        self.host_inputs = {slot: self._lift(slot, slot.read(opt), k) for k, slot in enumerate(lifted)}
        self._install()
        try:  # from here on, whatever happens, everything is put back
            self._install_params_and_state()
            self._run()
        finally:
            opt.state = self.saved_state
            elsewhere = self._put_back()
        if elsewhere:
            raise CaptureError(
                f"the step changes {', '.join(elsewhere[:4])}, which hocompile does not substitute "
                "(only the object's own param_groups, grads, state and attributes): a compiled step would "
                "not carry that state from one step to the next. Compile each sub-optimizer on its own, "
                "or keep such state in `state`"
            )
        return self._state_writes()

    def _lift(self, slot: HostSlot, real: Any, index: int) -> HyperParam:
        if isinstance(real, HyperParam):  # a group value swap_in_hyperparams already tracks: its real value
            real = self.tracker.real_value(real.expr)
        self.tracker.real[slot.name()] = real
        return self.tracker.make(sentinel(float(real), 500 + index, self.salt), input_expr(slot.name()))

    # -- 1. install ----------------------------------------------------------------------------
    def _install(self) -> None:
        """The fakes where the step reads its group and attribute tensors and its containers."""
        opt, groups = self.opt, self.opt.param_groups
        for host_slot, value in self.host_inputs.items():
            if host_slot.kind != "state" and not isinstance(host_slot.read(opt), HyperParam):
                host_slot.write(opt, value)
        self._install_group_and_attribute_tensors()
        self.fake_of = {id(real): self.by_slot[s] for s, real in zip(self.slots, self.real_inputs)}  # aliases
        for key, value in list(self.saved_attrs.items()):  # a tensor attribute that is a param's (w_q): its fake
            own = InputSlot.attribute(key) in self.by_slot
            if key != "state" and isinstance(value, torch.Tensor) and not own and id(value) in self.fake_of:
                setattr(opt, key, self.fake_of[id(value)])
        self.boxes = ContainerTrace(self.by_slot, self.fake_of)
        for key in container_attributes(opt):  # copies holding fakes: the real ones stay as they are
            setattr(opt, key, self.boxes.install(InputSlot.attribute(key), vars(opt)[key]))
        self.boxed_groups = [(g, key) for g, group in enumerate(groups) for key in group_containers(group)]
        for g, key in self.boxed_groups:
            groups[g][key] = self.boxes.install(InputSlot.group_entry(g, key), groups[g][key])
        self.installed = [dict(group) for group in groups]
        self.installed_attrs = dict(vars(opt))

    def _install_group_and_attribute_tensors(self) -> None:
        opt, groups = self.opt, self.opt.param_groups
        for input_slot, tensor in self.by_slot.items():
            if input_slot.kind not in ("attr", "group") or input_slot.leaf >= 0:
                continue
            real = slot_tensor(opt, input_slot)
            if input_slot.kind == "attr":
                setattr(opt, input_slot.key, tensor)
            else:
                groups[input_slot.group][input_slot.key] = tensor
            if tensor.dim() == 0:  # read with .item() (torch.optim's _get_value(lr)): a host counter
                name = f"opt.{input_slot.key}" if input_slot.kind == "attr" else f"g{input_slot.group}.{input_slot.key}"
                self.mode.track(tensor, name, real.item(), 1000 + len(self.mode.mirrors))
                self.counters.append(CounterRead(name, input_slot))

    def _install_params_and_state(self) -> None:
        by_slot = self.by_slot
        for g, group in enumerate(self.opt.param_groups):
            original = group["params"]
            present = range(len(original)) if self.view is None else self.view.get(g, [])
            params = [original[i] for i in present]
            for k, i in enumerate(present):
                p = original[i]
                if (slot := InputSlot.param(g, i)) not in by_slot:
                    self.fake_state[p] = dict(self.saved_state.get(p, {}))
                    continue
                fp = by_slot[slot]
                fp.grad = by_slot[InputSlot.grad(g, i)]
                self.mode.stand_ins[id(fp)] = p  # requires_grad, is_leaf: the real param's (stand_ins.py)
                where = f"param_groups[{g}]['params'][{i}]"
                self.param_attrs[(g, i)] = (fp, stand_ins.install(fp, p, where, lambda t: self.fake_of.get(id(t))))
                params[k] = fp
                self.fakes[(g, i)] = fp
                entry = self._fake_entry(self.saved_state.get(p, {}), g, i)
                for key in entry:
                    if (hs := HostSlot("state", key, g, i)) in self.host_inputs:
                        entry[key] = self.host_inputs[hs]
                self.fake_state[fp] = entry
                self.installed_state[(g, i)] = dict(entry)
            group["params"] = params
        self.opt.state = self.fake_state

    def _fake_entry(self, real_entry: dict[str, Any], g: int, i: int) -> dict[str, Any]:
        """One param's state with traced tensors; 0-d tensors become host counters."""
        entry = dict(real_entry)
        for key in entry:
            slot = InputSlot.state(g, i, key)
            if not isinstance(entry[key], torch.Tensor) and holds_tensors(entry[key]):
                entry[key] = self.boxes.install(slot, entry[key])
                continue
            if slot not in self.by_slot:
                continue
            entry[key] = self.by_slot[slot]
            if entry[key].dim() == 0:
                name = counter_name(g, i, key)
                self.mode.track(entry[key], name, real_entry[key].item(), 1000 + len(self.mode.mirrors))
                self.counters.append(CounterRead(name, slot))
        return entry

    # -- 2. run --------------------------------------------------------------------------------
    def _run(self) -> None:
        opt = self.opt
        # torch.compile'd helpers as opaque ops; with NS fusion on, not those that multiply matrices
        traced = {} if self.traced_helpers is None else self.traced_helpers
        helpers = opaque_compiled_helpers(opt, self.step, not self.opaque, traced)
        with self.mode, helpers:
            self.step(opt)
        for (g, i), (fp, attrs) in self.param_attrs.items():
            stand_ins.check_unchanged(fp, attrs, f"param_groups[{g}]['params'][{i}]")

    # -- 3. put back ---------------------------------------------------------------------------
    def _put_back(self) -> list[str]:
        """Every group value and attribute as it was; what the step changed outside them (a list of
        names, empty where nothing)."""
        opt, groups, boxes = self.opt, self.opt.param_groups, self.boxes
        assigns, values = self.attr_assigns, self.attr_values
        boxed = {
            (g, key) for g, key in self.boxed_groups
            if boxes.finish(InputSlot.group_entry(g, key), groups[g].get(key, MISSING), assigns, values)
        }
        for g, key, after in restore_groups(groups, self.saved_groups, self.installed):
            if (g, key) in boxed:
                continue
            base = InputSlot.group_entry(g, key)
            if boxes.assign_tensor(base, after, assigns, values) or boxes.finish(base, after, assigns, values):
                continue  # a tensor, or a container of tensors, the step put in the group
            self.changes.append(Change(HostSlot("group", key, g), self.saved_groups[g].get(key, MISSING), after))
        for key in sorted((set(vars(opt)) | set(self.installed_attrs)) - {"state"}):
            after = vars(opt).get(key, MISSING)
            slot = InputSlot.attribute(key)
            if boxes.finish(slot, after, assigns, values):
                pass  # a container of tensors: its writes are outputs
            elif after is not self.installed_attrs.get(key, MISSING) and not boxes.assign_tensor(
                slot, after, assigns, values
            ):
                self.changes.append(Change(HostSlot("attr", key), self.saved_attrs.get(key, MISSING), after))
            if key not in self.saved_attrs:
                delattr(opt, key)
            elif after is not self.saved_attrs[key]:
                setattr(opt, key, self.saved_attrs[key])
        elsewhere = self.reachable.changed()
        self.reachable.restore()
        return elsewhere

    # -- 4. state writes -----------------------------------------------------------------------
    def _state_writes(self) -> list[torch.Tensor]:
        """The graph's outputs: the state tensors the step assigned, then the attributes' and groups'."""
        values: list[torch.Tensor] = []
        for (g, i), fp in self.fakes.items():
            if fp.grad is None:
                self.clears.append((g, i))
            before = self.saved_state.get(self.opt.param_groups[g]["params"][i], {})
            ours = self.installed_state[(g, i)]
            # in the step's own insertion order: the graph's outputs must not depend on hashing
            for key in list(self.fake_state[fp]) + [k for k in ours if k not in self.fake_state[fp]]:
                value = self.fake_state[fp].get(key, MISSING)
                st = InputSlot.state(g, i, key)
                if self.boxes.finish(st, value, self.assigns, values):
                    continue
                if isinstance(value, torch.Tensor):
                    if self.by_slot.get(st) is not value:
                        self.assigns.append(st)
                        values.append(value)
                elif value is not ours.get(key, MISSING):
                    self.changes.append(Change(HostSlot("state", key, g, i), before.get(key, MISSING), value))
        self.assigns += self.attr_assigns
        return values + self.attr_values
