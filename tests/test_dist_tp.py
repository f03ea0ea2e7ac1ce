"""Tensor-parallel Newton–Schulz (hocompile/distributed/tensor_parallel.py) on threaded process groups.

Each rank holds ``torch.chunk(full, world, dim)[rank]`` of the same full
matrix; the reference is the single-process op on the full matrix, sliced
the same way.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from torch._subclasses import FakeTensorMode
from torch.distributed.tensor.debug import CommDebugMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.common_distributed import MultiThreadedTestCase

from hocompile.distributed.tensor_parallel import (
    BlockwiseWarning,
    NSArgs,
    blockwise_ns,
    chunk_sizes,
    distributed_ns,
    tp_newton_schulz,
)
from hocompile.distributed.tp_plan import (
    TPChoice,
    choose_tp_mode,
    crossover_long_side,
    ns_flops_as_given,
    rewrite_ns_node,
)
from hocompile.ir.decisions import decisions_of
from hocompile.ops import newton_schulz_math as ns
from hocompile.targets import CPU_DESCRIPTORS, gpu_target

KJ = [(3.4445, -4.7750, 2.0315)] * 5
QUINTIC = [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
           (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)]
CUBIC = [(1.5, -0.5, 0.0)] * 4
_LOGGER = "hocompile.distributed.tensor_parallel"
# make_fx patches torch globally while it traces: the rank threads take turns (a process per rank would not).
_TRACING = threading.Lock()


def ns_args(coefficients: list[tuple[float, float, float]], **options: object) -> NSArgs:
    a, b, c = (list(t) for t in zip(*coefficients))
    return NSArgs(a, b, c, 1e-7, **options)  # type: ignore[arg-type]


def full_matrix(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def single(full: torch.Tensor, args: NSArgs) -> torch.Tensor:
    return args.call_op(full)


def own(t: torch.Tensor, world: int, dim: int, rank: int) -> torch.Tensor:
    chunks = torch.chunk(t, world, dim)
    return chunks[rank] if rank < len(chunks) else t.narrow(dim, t.shape[dim], 0)


# ------------------------------------------------------------------ no process group


def test_chunk_sizes_follow_torch_chunk() -> None:
    for full in range(1, 12):
        for world in (1, 2, 3, 4):
            chunks = torch.chunk(torch.empty(full), world)
            expected = [len(c) for c in chunks] + [0] * (world - len(chunks))
            assert chunk_sizes(full, world) == expected, (full, world)


def test_blockwise_warns_and_equals_per_block_ns() -> None:
    full, args = full_matrix((6, 16)), ns_args(KJ, compute_dtype=torch.float32)
    for block in torch.chunk(full, 2, dim=1):
        with pytest.warns(BlockwiseWarning, match="differs from the unsharded"):
            got = blockwise_ns(block, 1, "unused", args)
        assert torch.equal(got, ns.newton_schulz(block, KJ, 1e-7, compute_dtype=torch.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a batch shard holds whole matrices: exact, no warning
        blockwise_ns(full_matrix((2, 4, 8)), 0, "unused", args)


def test_cost_model_crossover() -> None:
    h100, cpu = gpu_target("sm90"), CPU_DESCRIPTORS["cpu-avx2"]
    big = choose_tp_mode((1024, 65536), 1, 8, 5, h100)
    assert big.mode == "distributed" and "all-reduces of 1024x1024" in big.describe()
    assert choose_tp_mode((128, 512), 1, 2, 5, h100).mode == "duplicated"
    assert choose_tp_mode((64, 256), 1, 2, 5, cpu, compute_dtype=torch.float32).mode == "duplicated"
    assert choose_tp_mode((1024, 4096), 1, 2, 5, cpu, compute_dtype=torch.float32).mode == "distributed"
    # Without latency n* = 8T/β / (4T/R + e/(mβ)) < 2R/β (docstring); latency only raises it a little.
    m, steps, rate, bandwidth = 4096, 5, 989e12, 450e9
    formula = 8 * steps / bandwidth / (4 * steps / rate + 4 / (m * bandwidth))
    n_star = crossover_long_side(m, 8, steps, h100)
    assert formula <= n_star <= 2 * rate / bandwidth, (formula, n_star)  # 3970 <= 4236 <= 4395
    assert choose_tp_mode((m, n_star - 1), 1, 8, steps, h100).mode == "duplicated"
    # Sharding the Gram side (rows of a wide matrix, or columns of its transpose) cannot be distributed.
    rows = choose_tp_mode((1024, 65536), 0, 8, 5, h100)
    assert rows.mode == "duplicated" and "Gram side" in rows.reason
    assert choose_tp_mode((65536, 1024), 0, 8, 5, h100, transpose=True).mode == "distributed"
    # Blockwise only on request; requested modes are kept.
    assert all(choose_tp_mode((n, n), 1, 4, 5, h100).mode != "blockwise" for n in (8, 512, 8192))
    assert choose_tp_mode((128, 512), 1, 2, 5, h100, requested="blockwise").mode == "blockwise"
    assert choose_tp_mode((128, 512), 1, 2, 5, h100, requested="distributed").mode == "distributed"
    decision = big.decision()
    assert decision.chose["tp_mode"] == "distributed" and decision.alternatives[0].name == "duplicated"


def test_cost_model_prices_routing() -> None:
    h100 = gpu_target("sm90")
    # Many small matrices: routing spreads whole NS over the ranks and shares its two all-to-alls.
    flops = 64 * ns_flops_as_given((128, 512), 5)
    small = choose_tp_mode((128, 512), 1, 8, 5, h100, routed_matrices=64, routed_flops=flops)
    assert small.mode == "route" and set(small.predicted_s) == {"route", "duplicated", "distributed"}
    # One matrix that is all of the step's NS: its owner would work alone while the others wait.
    big = ns_flops_as_given((4096, 65536), 5)
    alone = choose_tp_mode((4096, 65536), 1, 8, 5, h100, routed_matrices=3, routed_flops=big * 1.01)
    assert alone.mode == "distributed" and alone.predicted_s["route"] > alone.predicted_s["distributed"]
    # Routing does not depend on the split: it is the cheaper one where distributed cannot run.
    rows = choose_tp_mode((128, 512), 0, 8, 5, h100, routed_matrices=64)
    assert rows.mode == "route" and "distributed" not in rows.predicted_s and "Gram side" in rows.reason
    assert choose_tp_mode((128, 512), 1, 8, 5, h100, routed_matrices=1, requested="route").mode == "route"
    with pytest.raises(ValueError, match="routed_matrices >= 1"):
        choose_tp_mode((128, 512), 1, 8, 5, h100, requested="route")
    assert ns_flops_as_given((7, 3), 5, transpose=True) == ns_flops_as_given((3, 7), 5) == 5 * (4 * 9 * 7 + 2 * 27)


# ------------------------------------------------------------------ threaded process groups


class _TP(MultiThreadedTestCase):
    def setUp(self) -> None:
        super().setUp()
        self._spawn_threads()

    def check_modes(
        self, shape: tuple[int, ...], dim: int, args: NSArgs, modes: tuple[str, ...], tol: float, comm: str = ""
    ) -> None:
        """Each mode's shard result against the op on the full matrix; ``comm``: the collective it must issue
        ("all_reduce": distributed really ran; "all_gather_into_tensor": it fell back; "none")."""
        full = full_matrix(shape, seed=len(shape) + dim)
        expected = own(single(full, args), self.world_size, dim, self.rank)
        local = own(full, self.world_size, dim, self.rank)
        for mode in modes:
            with CommDebugMode() as counter:
                got = tp_newton_schulz(local, dim, dist.group.WORLD, args, mode=mode, full_size=shape[dim])
            issued = {str(op).rpartition(".")[2] for op in counter.get_comm_counts()} or {"none"}
            assert not comm or issued == {comm}, (mode, shape, dim, issued)
            assert got.shape == expected.shape and got.dtype == expected.dtype, (mode, got.shape)
            if tol == 0.0:
                assert torch.equal(got, expected), (mode, shape, dim)
            else:
                err = (got.double() - expected.double()).abs().max().item() if got.numel() else 0.0
                assert err <= tol, (mode, shape, dim, err)


class TestWorld2(_TP):
    @property
    def world_size(self) -> int:
        return 2

    def test_fp32_columns_and_rows_square_and_rectangular(self) -> None:
        for algorithm, restarts in (("standard", ()), ("gram", (2,))):
            args = ns_args(KJ, compute_dtype=torch.float32, algorithm=algorithm, restarts=restarts)
            for shape in ((8, 8), (6, 20), (20, 6)):
                for dim in (0, 1):
                    self.check_modes(shape, dim, args, ("duplicated",), 0.0)  # the op on the gathered matrix
                    # Distributed only where the split is along the long side n of a wide (or square) X.
                    split_n = dim == 1 and shape[0] <= shape[1]
                    comm = "all_reduce" if split_n else "all_gather_into_tensor"
                    self.check_modes(shape, dim, args, ("distributed",), 1e-6 if split_n else 0.0, comm)

    def test_fp32_transpose_cubic_and_batched(self) -> None:
        args = ns_args(QUINTIC, compute_dtype=torch.float32, transpose=True)
        self.check_modes((20, 6), 0, args, ("distributed",), 1e-6, "all_reduce")  # X = xᵀ is wide, split on n
        cubic = ns_args(CUBIC, compute_dtype=torch.float32)
        self.check_modes((3, 6, 20), 2, cubic, ("distributed",), 1e-6, "all_reduce")
        # Split over the batch: whole matrices on every rank, the op itself, no traffic in any mode.
        args = ns_args(KJ, compute_dtype=torch.float32)
        self.check_modes((4, 6, 20), 0, args, ("duplicated", "distributed", "blockwise"), 0.0, "none")

    def test_bf16_compute(self) -> None:
        # Duplicated is the op itself. Distributed sums the fp32 partial Grams in another order before the
        # one bf16 rounding, so a product can land one bf16 ulp apart (128x512: up to 3e-3 from the op):
        # its error against fp64 (whole matrix) must stay the op's own: within 9% over 72 cases
        # (3 shapes, 2 coefficient sets, emulate/native, 6 seeds), so 10% allowed.
        for matmul in ("emulate", "native"):
            args = ns_args(KJ, compute_dtype=torch.bfloat16, out_dtype=torch.float32, matmul=matmul)
            self.check_modes((8, 32), 1, args, ("duplicated",), 0.0)
            for shape in ((8, 32), (128, 512)):
                full = full_matrix(shape)
                ref = own(ns.reference_fp64(full, KJ, 1e-7), 2, 1, self.rank)
                single_err = _max_over_ranks(own(single(full, args), 2, 1, self.rank).double() - ref)
                got = distributed_ns(own(full, 2, 1, self.rank), 1, dist.group.WORLD, args, full_size=shape[1])
                assert got.dtype == torch.float32
                assert _max_over_ranks(got.double() - ref) <= 1.1 * single_err, (matmul, shape, single_err)

    def test_empty_shard(self) -> None:
        # One column over two ranks: rank 1 holds an empty shard (torch.chunk), and contributes zeros.
        args = ns_args(KJ, compute_dtype=torch.float32)
        self.check_modes((1, 1), 1, args, ("duplicated",), 0.0, "all_gather_into_tensor")
        self.check_modes((1, 1), 1, args, ("distributed",), 1e-6, "all_reduce")
        self.check_modes((3, 1), 0, args, ("duplicated",), 0.0)  # rows 2 + 1; a 0-row shard at world 3 below

    def test_collectives_per_ns(self) -> None:
        full, steps = full_matrix((8, 24)), len(KJ)
        local = own(full, 2, 1, self.rank)
        args = ns_args(KJ, compute_dtype=torch.float32)
        with CommDebugMode() as comm:
            distributed_ns(local, 1, dist.group.WORLD, args, full_size=24)
        counts = {str(op): n for op, n in comm.get_comm_counts().items()}
        assert counts == {"c10d_functional.all_reduce": steps + 1}  # a Gram per iteration + the norm
        with CommDebugMode() as comm:
            distributed_ns(local, 1, dist.group.WORLD, ns_args(KJ, algorithm="gram", restarts=(2,)), full_size=24)
        assert comm.get_total_counts() == 3  # the first R, the restart's R, the norm
        with CommDebugMode() as comm:
            tp_newton_schulz(local, 1, dist.group.WORLD, args, mode="duplicated", full_size=24)
        assert {str(op): n for op, n in comm.get_comm_counts().items()} == {"c10d_functional.all_gather_into_tensor": 1}

    def test_row_shard_falls_back_to_duplicated(self) -> None:
        full, args = full_matrix((8, 24)), ns_args(KJ, compute_dtype=torch.float32)
        # Only rank 0 captures: assertLogs swaps the logger's handlers, which the threads share.
        capture = self.assertLogs(_LOGGER, logging.INFO) if self.rank == 0 else contextlib.nullcontext()
        with capture as logs, CommDebugMode() as comm:
            got = distributed_ns(own(full, 2, 0, self.rank), 0, dist.group.WORLD, args, full_size=8)
        assert torch.equal(got, own(single(full, args), 2, 0, self.rank))
        assert comm.get_total_counts() == 1
        assert self.rank != 0 or "distributed -> duplicated" in logs.output[0]

    def test_wrong_full_size_is_refused(self) -> None:
        local = own(full_matrix((8, 24)), 2, 1, self.rank)
        # Every rank must see the mismatch (30 columns: 15 each, not 12): one that did not would wait forever.
        with pytest.raises(ValueError, match="full_size=30"):
            tp_newton_schulz(local, 1, dist.group.WORLD, ns_args(KJ), mode="duplicated", full_size=30)

    @pytest.mark.filterwarnings("ignore::hocompile.distributed.tensor_parallel.BlockwiseWarning")
    def test_modes_trace_with_make_fx(self) -> None:
        local = own(full_matrix((8, 24)), 2, 1, self.rank)
        name = dist.group.WORLD.group_name
        for mode, collective, count in (
            ("distributed", "all_reduce", 6),
            ("duplicated", "all_gather_into_tensor", 1),
            ("blockwise", "all_reduce", 0),
        ):
            args = ns_args(KJ, compute_dtype=torch.float32)
            program = functools.partial(tp_newton_schulz, shard_dim=1, group=name, args=args, mode=mode, full_size=24)
            with _TRACING:  # traced on fake tensors: no collective runs while tracing
                gm = make_fx(program, tracing_mode="fake")(local)
            targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
            assert targets.count(f"_c10d_functional.{collective}.default") == count, mode
            assert targets.count("_c10d_functional.wait_tensor.default") == count, mode
            assert torch.equal(gm(local), program(local)), mode  # replay is bit-equal

    def test_rewrite_ns_node_in_a_graph(self) -> None:
        full = full_matrix((8, 24))
        local = own(full, 2, 1, self.rank)
        args = ns_args(KJ, compute_dtype=torch.float32)
        expected = -own(single(full, args), 2, 1, self.rank)
        name = dist.group.WORLD.group_name
        # (mode, eps as a graph input like a host scalar, collective the graph must hold)
        for mode, host_eps, collective in (
            ("distributed", False, "all_reduce"), ("duplicated", False, "all_gather_into_tensor"),
            ("duplicated", True, "all_gather_into_tensor"), ("distributed", True, "all_reduce"),
        ):
            gm, node = _ns_graph(local, args, host_eps)
            choice = TPChoice(mode, "from the test")
            with _TRACING:
                result = rewrite_ns_node(gm, node, shard_dim=1, group_name=name, mode=mode, full_size=24, choice=choice)
            gm.graph.lint()
            ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
            assert (torch.ops.hocompile.newton_schulz.default in ops) == (mode == "duplicated"), mode
            assert getattr(torch.ops._c10d_functional, collective).default in ops, mode
            assert decisions_of(result)[-1].chose == {"tp_mode": mode}
            got = gm(local, args.eps) if host_eps else gm(local)
            err = (got - expected).abs().max().item()
            assert err <= (0.0 if mode == "duplicated" else 1e-6), (mode, err)
            if host_eps:  # eps is read at run time: a clamp at 1e3 (above the norm) changes the result
                big = -own(single(full, NSArgs(**{**args.__dict__, "eps": 1e3})), 2, 1, self.rank)
                err = (gm(local, 1e3) - big).abs().max().item()
                assert err <= (0.0 if mode == "duplicated" else 1e-6) and not torch.equal(big, expected), (mode, err)


def _ns_graph(local: torch.Tensor, args: NSArgs, host_eps: bool) -> tuple[fx.GraphModule, fx.Node]:
    """x -> hocompile.newton_schulz -> neg, as fuse-newton-schulz leaves it; eps a float or a graph input."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = FakeTensorMode().from_tensor(local)
    eps = graph.placeholder("eps") if host_eps else args.eps
    op_args = (list(args.a), list(args.b), list(args.c), eps, args.eps_mode, args.transpose, args.compute_dtype,
               args.out_dtype or torch.float32, args.algorithm, list(args.restarts), args.matmul, args.blocks,
               args.schedule)
    node = graph.call_function(torch.ops.hocompile.newton_schulz.default, (x, *op_args))
    graph.output(graph.call_function(torch.neg, (node,)))  # a user of the result (exact)
    return fx.GraphModule(torch.nn.Module(), graph), node


def _max_over_ranks(diff: torch.Tensor) -> float:
    worst = diff.abs().max().reshape(1)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.item()


class TestWorld3(_TP):
    @property
    def world_size(self) -> int:
        return 3

    def test_uneven_shards(self) -> None:
        args = ns_args(KJ, compute_dtype=torch.float32)
        # 7 columns over 3 ranks: 3, 3, 1; 4 columns: 2, 2, 0 (rank 2 empty).
        for shape in ((5, 7), (3, 4)):
            self.check_modes(shape, 1, args, ("duplicated",), 0.0, "all_gather_into_tensor")
            self.check_modes(shape, 1, args, ("distributed",), 1e-6, "all_reduce")
        # 5 rows: 2, 2, 1; 4 rows: 2, 2, 0. Rows are the Gram side: distributed falls back to duplicated.
        for shape in ((5, 12), (4, 12)):
            self.check_modes(shape, 0, args, ("duplicated", "distributed"), 0.0, "all_gather_into_tensor")
