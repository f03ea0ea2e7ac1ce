"""hocompile's passes inside Inductor: ``hocompile.inductor_passes()``.

    pre, post = hocompile.inductor_passes()
    torch._inductor.config.post_grad_custom_pre_pass = pre
    torch._inductor.config.post_grad_custom_post_pass = post
    train_step = torch.compile(train_step)   # forward, backward and opt.step()

``pre`` runs hocompile's pipeline on every post-grad graph Inductor compiles (functional aten,
input mutations as trailing ``copy_``): Newton–Schulz chains become ``hocompile::`` ops, planned
(batched, precision) as ``compile_optimizer`` plans them, and the graph is rebuilt in place with
them. Inductor then lowers the rest with its own fusion; hocompile's registered ops reach it as
custom ops (extern kernels: their fake implementations give it shapes). A graph without anything
hocompile plans (a model's forward) is left exactly as it was. ``post`` records the graph as
Inductor's own post-grad passes left it, for ``hocompile.explain_last()``.

Both carry a ``uuid()``: hocompile's version, its sources, the settings and the pipeline
planned for the device. Inductor's FX-graph cache key includes it, so a changed plan (another
precision, a disabled pass, an edited pass) compiles afresh instead of reusing a stale kernel.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from ..errors import BackendFallbackWarning
from ..ir.graph import ROLE
from ..settings import Settings
from .graphs import GraphRecord, NotHocompileIR, prepare, run_passes
from .last import last_records, remember
from .recompose import recompose

log = logging.getLogger(__name__)

_PACKAGE = Path(__file__).resolve().parent.parent


class InductorPasses(NamedTuple):
    pre: HocompilePrePass
    post: HocompilePostPass


def inductor_passes(device: str | torch.device | None = None, **options: Any) -> InductorPasses:
    """The passes to install as ``torch._inductor.config.post_grad_custom_pre_pass`` / ``_post_pass``.

    ``options`` are compile_optimizer's keywords (``disable_passes``, ``precision``, ...);
    ``device`` is what the plan is made for (default: CUDA where there is one, else the CPU)."""
    settings = Settings.resolve(**options)
    where = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    pre = HocompilePrePass(settings, where)
    return InductorPasses(pre, HocompilePostPass(pre.uuid()))


class HocompilePrePass(CustomGraphPass):
    """hocompile's pipeline on one post-grad graph, rebuilt in place."""

    def __init__(self, settings: Settings, device: torch.device) -> None:
        self.settings, self.device = settings, device
        self.graphs = 0
        self._uuid = _uuid(settings, device)

    def __call__(self, graph: fx.Graph) -> None:
        self.graphs += 1
        owner = graph.owning_module
        record = GraphRecord("inductor pass", f"post-grad graph {self.graphs}")
        if owner is None:
            record.declined = "the graph has no owning module"
            remember(record)
            return
        work = fx.GraphModule(owner, _copied(graph))
        recompose(work.graph)  # Inductor's decompositions back to the aten hocompile's passes match
        try:
            prepared = prepare(work, eager_alpha=False)
            # planned for the ops' torch.library kernels, which Inductor calls (not hocompile's Triton)
            run_passes(prepared, self.settings, record, self.device, "aten", inductor=True)
        except NotHocompileIR as exc:  # Inductor compiles it as it would without hocompile
            record.declined = str(exc)
            remember(record)
            log.info("hocompile inductor pass: %s left alone: %s", record.title, exc)
            return
        except Exception as exc:  # a pass failing on a graph it was not built for: the graph is untouched
            record.declined = f"hocompile failed on it ({type(exc).__name__}: {exc})"
            remember(record)
            warnings.warn(
                f"hocompile inductor pass: {record.title} compiled without hocompile's passes: {record.declined}",
                BackendFallbackWarning, stacklevel=2,
            )
            return
        if not record.after.get("hocompile ops"):
            record.lowering = "inductor (graph unchanged: nothing hocompile plans)"
            remember(record)
            return
        _rebuild(graph, prepared.gm.graph, prepared.copy_into, prepared.returned, prepared.nones)
        record.lowering = "inductor (hocompile ops as extern kernels)"
        remember(record)
        done = ", ".join(f"{r.name} {r.status}" for r in record.passes)
        log.info("hocompile inductor pass: %s: %s", record.title, done)

    def uuid(self) -> Any:
        return self._uuid


class HocompilePostPass(CustomGraphPass):
    """Records the graph as Inductor's post-grad passes left it (the last record's ``final_graph``)."""

    def __init__(self, uuid: str) -> None:
        self._uuid = uuid

    def __call__(self, graph: fx.Graph) -> None:
        records = last_records(1)
        if records and records[0].route == "inductor pass" and not records[0].declined:
            ops = sum(1 for n in graph.nodes if n.op == "call_function")
            hocompile_ops = [n for n in graph.nodes if n.op == "call_function" and "hocompile" in str(n.target)]
            records[0].lowering += f"; after Inductor's post-grad passes: {ops} ops, {len(hocompile_ops)} hocompile ops"

    def uuid(self) -> Any:
        return self._uuid + ":post"


def _copied(graph: fx.Graph) -> fx.Graph:
    out = fx.Graph()
    out.output(out.graph_copy(graph, {}))
    return out


def _rebuild(
    graph: fx.Graph, planned: fx.Graph, copy_into: list[int | None], returned: int, nones: list[int]
) -> None:
    """Replace ``graph``'s nodes by ``planned``'s, in place (Inductor holds ``graph``), the
    write-backs made trailing ``copy_`` into the inputs again."""
    old_placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node in reversed(list(graph.nodes)):
        if node.op != "placeholder":
            graph.erase_node(node)
    env: dict[fx.Node, fx.Node] = {}
    new_placeholders = [n for n in planned.nodes if n.op == "placeholder"]
    for old, new in zip(old_placeholders, new_placeholders):
        env[new] = old
    output = None
    for node in planned.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            output = node
            break
        env[node] = graph.node_copy(node, env.__getitem__)
        env[node].meta.pop(ROLE, None)
    assert output is not None
    values = [env[v] for v in output.args[0]]
    for dest, value in zip(copy_into, values):
        if dest is not None:
            graph.call_function(torch.ops.aten.copy_.default, (old_placeholders[dest], value))
    own: list[fx.Node | None] = list(values[:returned])
    for k in nones:  # the graph's None outputs (grads of inputs that need none), where they were
        own.insert(k, None)
    graph.output(tuple(own))
    graph.lint()


def _uuid(settings: Settings, device: torch.device) -> str:
    from importlib.metadata import PackageNotFoundError, version

    from ..runtime.compile_step import step_pipeline

    try:
        __version__ = version("hocompile")
    except PackageNotFoundError:  # a source tree: the passes' sources below still key it
        __version__ = "source"

    pipeline, _ = step_pipeline(settings, device, "aten", stack_calls=False)
    identity = ";".join(p.identity() for p in pipeline if p.name not in settings.disabled_passes)
    digest = hashlib.sha256()
    parts = (__version__, identity, str(device), str(settings.precision), repr(sorted(settings.disabled_passes)))
    for part in (*parts, _sources_digest()):
        digest.update(part.encode())
    return digest.hexdigest()


@functools.cache
def _sources_digest() -> str:
    """hocompile's sources (the passes, the ops they insert, this bridge), read once per process:
    the backend asks for a uuid per frame it hands to Inductor."""
    digest = hashlib.sha256()
    for path in sorted(_PACKAGE.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()
