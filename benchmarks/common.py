"""What the benchmarks share: parsing, the command that reproduces a run, the machine's
description, markdown tables, medians and confidence intervals, plain TorchRec and a lone rank
engine, and writing a result block into a docs page (re-read right before, replaced atomically).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import random
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from raytrec.config import ModelConfig, TrainConfig, criteo_tables

if TYPE_CHECKING:
    from raytrec.engine.rank_engine import RankEngine

ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")


def replace_block(path: Path, block: str, *, name: str, heading: str | None = None) -> None:
    """Replaces the block ``name`` of the page ``path`` by ``block``; a page without it gets it
    appended under ``heading`` as a new last section (refused without a heading)."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    text = path.read_text() if path.exists() else ""
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        new = f"{head}{begin}\n{block.strip()}\n{end}{rest.split(end, 1)[1]}"
    elif heading is not None:
        new = f"{text.rstrip()}\n\n{heading}\n\n{begin}\n{block.strip()}\n{end}\n".lstrip()
    else:
        raise SystemExit(f"{path} has no {begin} ... {end} block to replace")
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(new)
    os.replace(tmp, path)


def parser(doc: str | None, module: str, page: str) -> argparse.ArgumentParser:
    """The parser of ``benchmarks.<module>``, described by its module doc's first paragraph, with
    ``--write``; its namespace holds ``module`` (for :func:`publish`)."""
    about, fmt = (doc or "").split("\n\n")[0], argparse.ArgumentDefaultsHelpFormatter
    p = argparse.ArgumentParser(
        prog=f"python -m benchmarks.{module}", description=about, formatter_class=fmt
    )
    p.set_defaults(module=module)
    write = f"write the result block into this page (its page: {page}); without it, print only"
    p.add_argument("--write", type=Path, metavar="PAGE", help=write)
    return p


def parse(p: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parses ``argv`` (default: the command line), kept less ``--write``; ``started``: now."""
    argv = list(sys.argv[1:] if argv is None else argv)
    a = p.parse_args(argv)
    a.argv, a.started = drop_options(argv, "--write"), time.perf_counter()
    return a


def dims(text: str, n: int) -> tuple[int, ...]:
    """``text`` as ``n`` positive integers joined by x: ``"2x1"``, ``"26x10000x16"``."""
    try:
        out = tuple(int(x) for x in text.lower().split("x"))
    except ValueError:
        out = ()
    if len(out) != n or min(out) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not {n} positive integers joined by x")
    return out


def dims_list(n: int) -> Callable[[str], list[tuple[int, ...]]]:
    """An argparse type: comma-separated :func:`dims` of ``n``."""
    return lambda text: [dims(x, n) for x in text.split(",")]


def drop_options(argv: Sequence[str], *names: str) -> list[str]:
    """``argv`` without the options ``names`` (``--name VALUE`` or ``--name=VALUE``)."""
    out: list[str] = []
    skip = False
    for token in argv:
        if not skip and token.split("=", 1)[0] not in names:
            out.append(token)
        skip = not skip and token in names
    return out


def command(a: argparse.Namespace, *dropped: str) -> str:
    """The command line that reproduces the run ``a``, less the options ``dropped``."""
    argv = drop_options(a.argv, *dropped)
    return shlex.join([".venv/bin/python", "-m", f"benchmarks.{a.module}", *argv])


def machine(*, gpu: bool = False) -> str:
    """One line: cores, CPU, load (the machine may be shared) and the stack's versions."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    try:
        ray = f"ray {version('ray')}"
    except PackageNotFoundError:  # a GPU host's run of a benchmark that needs no Ray
        ray = "no ray"

    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    names = [x.split(":", 1)[1].strip() for x in info.splitlines() if x.startswith("model name")]
    cpu = names[0] if names else platform.machine()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    device = f", GPU {torch.cuda.get_device_name(0)}" if gpu and torch.cuda.is_available() else ""
    return (
        f"{len(os.sched_getaffinity(0))} CPU cores ({cpu}){device}, load average {load} at the "
        f"end; Python {platform.python_version()}, torch {torch.__version__}, {ray}"
    )


def publish(
    a: argparse.Namespace, body: str, *, name: str, heading: str | None = None, gpu: bool = False
) -> None:
    """Prints the result block (when, on what, the command, ``body``); writes it to ``--write``."""
    took = time.perf_counter() - a.started
    length = f"{took:.0f} s" if took < 600 else f"{took / 60:.0f} min"
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    block = f"Measured on {stamp} (whole run {length}); {machine(gpu=gpu)}.\n\n    {command(a)}\n"
    block += f"\n{body}"
    print(block)
    if a.write:
        replace_block(a.write, block, name=name, heading=heading)


def dlrm_job(model: tuple[int, ...], *, batch_size: int, world_size: int, **kw: Any) -> TrainConfig:
    """The job of the raytrec-against-TorchRec benchmarks: a :func:`dlrm` of ``model`` (tables,
    rows, dim) sharded table-wise on ``world_size`` ranks of one gang, row-wise Adagrad
    embeddings and an Adagrad dense optimizer; ``kw``: further :class:`TrainConfig` fields."""
    from raytrec.config import DataConfig, OptimizerConfig, ScalingConfig

    use_gpu = kw.pop("use_gpu", False)
    gang = ScalingConfig(num_workers=world_size, gang_size=world_size, use_gpu=use_gpu)
    return TrainConfig(
        model=dlrm(*model), optimizer=OptimizerConfig(embedding="rowwise_adagrad", dense="adagrad"),
        scaling=gang, data=DataConfig(batch_size=batch_size), **kw,
    )  # fmt: skip


def dlrm(tables: int, rows: int, dim: int, width: int = 64) -> ModelConfig:
    """A DLRM over ``tables`` Criteo-style tables of ``rows`` x ``dim``, its MLPs ``width`` wide."""
    return ModelConfig(
        tables=criteo_tables(num_features=tables, num_embeddings=rows, embedding_dim=dim),
        dense_arch_layers=(width, dim), over_arch_layers=(width, 1),
    )  # fmt: skip


def plain_torchrec(cfg: TrainConfig, num_dense: int, device: Any, plan: Any) -> tuple[Any, Any]:
    """Plain TorchRec, built as a raytrec rank builds its model: ``cfg``'s model sharded by
    ``DistributedModelParallel`` over the default process group on ``plan``, and the dense
    optimizer over its parameters that have no fused optimizer."""
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from raytrec.engine.dense_optimizer import build_dense_optimizer
    from raytrec.engine.plan import apply_embedding_optimizer, sharders
    from raytrec.models import build_train_model

    model = build_train_model(cfg.model, num_dense, device, cfg.seed)
    apply_embedding_optimizer(model, cfg.optimizer)
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    dmp = DistributedModelParallel(model, env, device, plan=plan, sharders=sharders())
    dense = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    return dmp, build_dense_optimizer(dense, cfg.optimizer)


def rank_engine(
    cfg: TrainConfig, plan: Any, num_dense: int
) -> tuple[RankEngine, Callable[[], None]]:
    """A built rank engine for ``cfg`` alone (one gang of one rank): ``(engine, close)``."""
    import torch.distributed as dist

    from raytrec.engine.rank_engine import RankSpec, StoreAddress
    from simulation.gloo_job import engine_for

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    address = StoreAddress(host="127.0.0.1", port=store.port)
    spec = RankSpec(
        rank=0, gang=0, gang_rank=0, gang_size=1, config=cfg, plan=plan, num_dense=num_dense,
        store=address,
    )  # fmt: skip
    stack = contextlib.ExitStack()
    stack.callback(store.set, "closed", "1")  # the store's server (this object) lives until then
    return stack.enter_context(engine_for(spec)), stack.close


def md_table(heads: str, rows: Iterable[Sequence[object]], *, left: int = 1) -> str:
    """A markdown table of ``heads`` (``"a | b"``) and ``rows``, the first ``left`` left-aligned."""
    head = heads.split(" | ")
    lines = [head, ["---"] * left + ["---:"] * (len(head) - left), *rows]
    return "\n".join("| " + " | ".join(map(str, cells)) + " |" for cells in lines)


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    t0 = time.perf_counter()
    return fn(), time.perf_counter() - t0


def spread(values: Sequence[float | None], spec: str = ".2f", unit: str = "") -> str:
    """Median and its ``unit``, with (min to max) when there are several; ``-`` for none."""
    xs = [x for x in values if x is not None]
    if not xs:
        return "-"
    mid = format(statistics.median(xs), spec) + unit
    return mid if len(xs) == 1 else f"{mid} ({min(xs):{spec}} to {max(xs):{spec}})"


def bootstrap_median_ci(values: Sequence[float]) -> tuple[float, float]:
    """A 95% percentile-bootstrap interval for the median of ``values`` (5,000 seeded resamples)."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(5000))
    return medians[125], medians[4875]


def ratio_ci(ratios: Sequence[float], spec: str = ".2f", brackets: str = "[{}, {}]") -> str:
    """The median of paired ratios and its 95% bootstrap interval; with under 3, their range."""
    mid = format(statistics.median(ratios), spec)
    if len(ratios) < 3:
        return f"{mid} (range {min(ratios):{spec}} - {max(ratios):{spec}})"
    return f"{mid} {brackets.format(*(format(x, spec) for x in bootstrap_median_ci(ratios)))}"
