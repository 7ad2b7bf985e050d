"""`ragblend bench kv`: blend TTFT with the chunks' KV in memory, on disk (float16, int4) and in Redis, streamed
pipelined, and as the loading planner plans it (`+auto`), against a full prefill; load throughput per tier
(docs/benchmarks/kv-store.md, kv-planner.md). Retired in issue 64: the `disk-int8` and loader-priority
(`+normal`) rows (`git show 66ac7e4:bench/store/kv.py`), the rows not pipelined (`git show 50937cd:bench/store/kv.py`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from statistics import mean
from typing import Callable, Sequence

import torch

from app.readiness import free_port
from bench.harness.args import add_data, add_out
from bench.harness.engine import load_engine, parse_spec
from bench.harness.output import emit_summary, fmt, table
from blend_engine.kv import KVShape
from blend_engine.types import BlendConfig, PrefillMode, PrefillResult, Segment
from configs.enums import KVQuantization, StorageDtype
from kv_store import KVStore, StoreConfig, Tier
from kv_store.loader import StoredChunk, handles_in
from kv_store.planner import LoadPlan, PlanKind, PlanRequest
from runtime.planning import measure_engine


@dataclasses.dataclass(frozen=True)
class Streamed:
    """A blend run whose chunk caches stream from one store, pipelined (the store's default: layer i+1 read
    while the engine computes layer i)."""

    name: str
    store: str
    is_auto: bool = False  # plan=auto: the loading planner picks full, blend (its ratio) or mixed


VARIANT_TIER = "disk-int4"  # a --variant's streamed row reads the tier the server's disk entries are in

STREAMED = [Streamed("disk+pipe", "disk"), Streamed("redis+pipe", "redis"), Streamed("disk-int4+pipe", "disk-int4"),
            Streamed("disk+pipe+auto", "disk", is_auto=True), Streamed("redis+pipe+auto", "redis", is_auto=True)]
TIERS = ("disk", "redis", "disk-int4")


PromptFn = Callable[[Sequence[object]], list[Segment]]  # per-chunk caches (or None) -> prompt segments


def fit_planners(engine, stores: dict[str, KVStore], blend: BlendConfig, sizes: Sequence[int]) -> None:
    """One set of timed prefills, observed by every store's planner (they share the engine)."""
    samples = measure_engine(engine, sizes, blend)
    for store in stores.values():
        for shape, seconds in samples:
            store.planner.observe(shape, seconds)


def planned_prefill(engine, store: KVStore, handles: list[StoredChunk], prompt: PromptFn, blend: BlendConfig,
                    start_layer: int) -> tuple[PrefillResult, LoadPlan]:
    segments = prompt(handles)
    num_fresh = sum(len(s.token_ids) for s in segments) - sum(h.num_tokens for h in handles)
    request = PlanRequest(handles, sum(len(s.token_ids) for s in segments), num_fresh, start_layer,
                          engine.num_layers)
    plan = store.plan(request)
    if plan.kind is PlanKind.FULL:
        return engine.prefill(prompt([None] * len(handles)), mode=PrefillMode.FULL), plan
    used = [h if is_reused else None for h, is_reused in zip(handles, plan.reused_mask(handles))]
    result, _ = streamed_prefill(engine, store, prompt(used), dataclasses.replace(blend, recompute_ratio=plan.ratio),
                                 start_layer)
    return result, plan


def streamed_prefill(engine, store: KVStore, segments: list[Segment], blend: BlendConfig,
                     start_layer: int) -> tuple[PrefillResult, float]:
    """A blend prefill whose chunks' KV streams from `store`, pipelined; and the ms the engine blocked on it."""
    source = store.layer_source(handles_in(segments), engine.device, engine.dtype, pipelined=True,
                                start_layer=start_layer, recompute=engine.precompute)
    try:
        result = engine.prefill(segments, blend=blend, kv_source=source)
    finally:
        source.close()
    return result, source.stats.wait_seconds * 1000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_data(parser, questions=5, passages=10)
    add_out(parser)
    parser.add_argument("--model", default=None, help="model name (default: settings' model.name)")
    parser.add_argument("--ratio", type=float, default=None, help="blend recompute ratio (default: settings)")
    parser.add_argument("--dtype", default="float16", choices=[d.value for d in StorageDtype], help="storage dtype")
    parser.add_argument("--repeats", type=int, default=3, help="runs per measurement; the fastest is kept")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own)")
    parser.add_argument("--redis-url", default=None, help="Redis to use; default: start redis-server on loopback")
    parser.add_argument("--throttle-mbps", action="append", default=[], metavar="TIER=N",
                        help="simulate a slow tier (disk or redis) at N MB/s; repeatable")
    parser.add_argument("--variant", action="append", default=[], metavar="SPEC",
                        help="blend config fields over the settings' (as bench engine's --variant, e.g. "
                             f"\"probe_layer=18 probe_budget=0.3\"): its blend from memory and streamed from "
                             f"{VARIANT_TIER}, timed in turn with the default's rows; repeatable")


class LocalRedis:
    """A throw-away redis-server on 127.0.0.1 (no persistence) for the bench's Redis tier."""

    def __init__(self, workdir: Path):
        self.port = free_port()
        cmd = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
               "--dir", str(workdir)]
        self._proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.1).close()
                return
            except OSError:
                time.sleep(0.05)
        self.close()
        raise RuntimeError("redis-server did not start")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def close(self) -> None:
        self._proc.terminate()
        self._proc.wait(timeout=10)


def drop_page_cache(store: KVStore, keys: list[str]) -> None:
    """Evict the entries' files from the page cache (per file: leaves other processes' cache alone)."""
    disk = store.backend(Tier.DISK)  # a throttled tier passes `path` through
    for key in keys:
        fd = os.open(disk.path(key), os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def make_stores(fingerprint: str, shape: KVShape, base: StoreConfig, workdir: Path, redis_url: str | None,
                throttles: dict[Tier, float]) -> dict[str, KVStore]:
    """One store per tier (so each row reads from exactly one), with the settings' other choices."""
    base = dataclasses.replace(base, max_memory_bytes=0, disk_enabled=False, disk_dir=None, redis_url=None,
                               fsync=False, quantization=KVQuantization.NONE, write_tiers=frozenset(Tier),
                               throttle_mbps=throttles)
    configs = {
        "memory": dataclasses.replace(base, max_memory_bytes=1 << 40),
        "disk": dataclasses.replace(base, disk_enabled=True, disk_dir=workdir / "disk"),
        "disk-int4": dataclasses.replace(base, disk_enabled=True, disk_dir=workdir / "disk-int4",
                                         quantization=KVQuantization.INT4),
    }
    if redis_url:
        configs["redis"] = dataclasses.replace(base, redis_url=redis_url)
    return {name: KVStore(fingerprint, config, shape=shape) for name, config in configs.items()}


def best_of(num_repeats: int, fns: dict) -> tuple[dict, dict]:
    """Run each measurement `num_repeats` times round-robin (contention hits all alike); keep the min ms."""
    best: dict[str, float] = {}
    results: dict = {}
    for _ in range(num_repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            results[name] = fn()
            best[name] = min(best.get(name, float("inf")), (time.perf_counter() - start) * 1000)
    return best, results


def run_question(engine, stores, item, args, blend, sink, variants: dict[str, BlendConfig]) -> dict:
    chunk_ids = [tuple(engine.tokenize(c["text"])) for c in item["ctxs"][: args.passages]]
    # keys differ per store: the storage format (dtype, int8) is part of every key
    keys = {name: [store.key_for(ids, sink) for ids in chunk_ids] for name, store in stores.items()}
    for idx, ids in enumerate(chunk_ids):
        kv = engine.precompute(ids, sink)
        for name, store in stores.items():
            store.put(keys[name][idx], kv)
    question, start_layer = item["question"], blend.first_check_layer

    def prompt(caches):
        return engine.build_segments(question, [Segment(ids, c) for ids, c in zip(chunk_ids, caches)])

    source_wait_ms: dict[str, float] = {}  # time the engine blocked on the store's source (last run)
    plans: dict[str, str] = {}  # plan=auto rows: what the planner chose (last run)

    def streamed(spec: Streamed, config: BlendConfig = blend):
        store, store_keys = stores[spec.store], keys[spec.store]

        def fn():
            if spec.store != "redis":
                drop_page_cache(store, store_keys)  # a cold read: the entries are not in the page cache
            handles = [store.handle(k) for k in store_keys]
            if spec.is_auto:
                result, plan = planned_prefill(engine, store, handles, prompt, config,
                                               config.first_check_layer)
                plans[spec.name], source_wait_ms[spec.name] = plan.kind.value, result.stats.kv_load_ms
                return result
            result, source_wait_ms[spec.name] = streamed_prefill(engine, store, prompt(handles), config,
                                                                 config.first_check_layer)
            return result

        return fn

    def from_memory(config: BlendConfig):
        return lambda: engine.prefill(prompt([mem_store.get(k) for k in mem_keys]), blend=config)

    mem_store, mem_keys = stores["memory"], keys["memory"]
    # the baseline runs once: it is the slowest by far and only sets the scale
    full = {"full": lambda: engine.prefill(prompt([None] * len(chunk_ids)), mode=PrefillMode.FULL)}
    full_ms, full_results = best_of(1, full)
    fns = {"memory": from_memory(blend)}
    fns.update({spec.name: streamed(spec) for spec in STREAMED if spec.store in stores})
    for spec, variant in variants.items():  # the same computations under another blend config
        fns["memory " + spec] = from_memory(variant)
        fns[f"{VARIANT_TIER}+pipe {spec}"] = streamed(Streamed(f"{VARIANT_TIER}+pipe {spec}", VARIANT_TIER), variant)
    for tier in TIERS:
        if tier in stores:
            fns["load_alone:" + tier] = load_alone(engine, stores[tier], keys[tier], start_layer, tier != "redis")
    row, results = best_of(args.repeats, fns)
    row.update(full_ms)
    results.update(full_results)
    ref = results["memory"]
    row["compute_alone"] = row["memory"]  # the KV is already in memory: the recompute alone
    row["num_tokens"] = len(ref.token_ids)
    agree = {"full": int(results["full"].logits.argmax() == ref.logits.argmax())}
    row["auto_ratio"] = results["disk+pipe+auto"].stats.recompute_ratio or 1.0  # full: everything computed
    row["plans"] = plans
    for name in (spec.name for spec in STREAMED if spec.store in stores):
        agree[name] = int(results[name].logits.argmax() == ref.logits.argmax())
        row[name + ":kv_wait"] = results[name].stats.kv_load_ms  # engine side: includes its concat
        row[name + ":source_wait"] = source_wait_ms[name]  # blocked on loads alone
        row[name + ":max_logit_diff"] = float((results[name].logits - ref.logits).abs().max())
    for spec in variants:
        row[f"{VARIANT_TIER}+pipe {spec}:source_wait"] = source_wait_ms[f"{VARIANT_TIER}+pipe {spec}"]
    for tier in TIERS:
        if tier in stores:
            row["bytes:" + tier] = results["load_alone:" + tier]
    row["agree"] = agree
    return row


def replace_spec(blend: BlendConfig, spec: str) -> BlendConfig:
    """`blend` with a --variant's fields (the engine's prefill fits its probe to the model)."""
    return dataclasses.replace(blend, **parse_spec(blend, spec))


def load_alone(engine, store, keys, start_layer, is_disk):
    """Reads the layers the blend prefill reads, with no compute (cold page cache on disk); -> bytes."""

    def fn() -> int:
        if is_disk:
            drop_page_cache(store, keys)
        handles = [store.handle(k) for k in keys]
        source = store.layer_source(handles, engine.device, engine.dtype, pipelined=False)
        for layer in range(start_layer, engine.num_layers):
            source.layer(layer)
        source.close()
        return source.stats.num_bytes_loaded

    return fn


def summarize(rows: list[dict]) -> dict:
    summary = {k: mean(r[k] for r in rows) for k in rows[0] if k not in ("agree", "plans") and all(k in r for r in rows)}
    summary["plans"] = {name: sorted({r["plans"][name] for r in rows}) for name in rows[0]["plans"]}
    summary["top1_agreement_vs_memory_blend"] = {k: mean(r["agree"][k] for r in rows) for k in rows[0]["agree"]}
    for tier in TIERS:
        if "load_alone:" + tier in summary:
            summary["throughput_MBps:" + tier] = summary["bytes:" + tier] / summary["load_alone:" + tier] / 1e3
    for tier in TIERS:
        if tier + "+pipe" not in summary:
            continue
        load, compute = summary["load_alone:" + tier], summary["compute_alone"]
        summary[f"target:{tier}+pipe<=1.1*max"] = summary[tier + "+pipe"] <= 1.1 * max(load, compute)
        summary[f"ratio:{tier}+pipe/memory"] = summary[tier + "+pipe"] / summary["memory"]
        if tier + "+pipe+auto" in summary:  # the planner's target: never worse than the best fixed plan
            best = min(summary["full"], summary[tier + "+pipe"])
            summary[f"target:{tier}+pipe+auto<=1.05*min(full,blend)"] = summary[tier + "+pipe+auto"] <= 1.05 * best
    return summary


def print_table(s: dict) -> None:
    agree = s["top1_agreement_vs_memory_blend"]
    streamed = [spec.name for spec in STREAMED if spec.name in s]
    print(table(["config", "TTFT ms", "x memory", "load wait ms", "top1=mem"], [
        ["full", fmt(s["full"]), fmt(s["full"] / s["memory"], 2), "-", fmt(agree["full"], 2)],
        ["blend memory", fmt(s["memory"]), fmt(1.0, 2), "-", fmt(1.0, 2)],
        *(["blend " + name, fmt(s[name]), fmt(s[name] / s["memory"], 2), fmt(s[name + ":source_wait"]),
           fmt(agree[name], 2)] for name in streamed)]))
    print(f"(auto: the loading planner chose {s['plans']}; disk ratio {s['auto_ratio']:.3f})\n")
    streamed_default = f"{VARIANT_TIER}+pipe"
    specs = [k.removeprefix("memory ") for k in s if k.startswith("memory ")]
    if specs and streamed_default in s:  # each --variant against the default, the same tier, timed in turn
        print(table(["variant", "memory ms", "x default", f"{streamed_default} ms", "x default", "load wait ms"], (
            [spec, fmt(s["memory " + spec]), fmt(s["memory " + spec] / s["memory"], 3),
             fmt(s[f"{streamed_default} {spec}"]), fmt(s[f"{streamed_default} {spec}"] / s[streamed_default], 3),
             fmt(s[f"{streamed_default} {spec}:source_wait"])] for spec in specs)))
        print(f"(default: memory {fmt(s['memory'])} ms, {streamed_default} {fmt(s[streamed_default])} ms, "
              f"load wait {fmt(s[streamed_default + ':source_wait'])} ms)\n")
    print(table(["tier", "load alone ms", "MB/s", "compute alone ms", "1.1*max ms"], (
        [tier, fmt(s["load_alone:" + tier]), fmt(s["throughput_MBps:" + tier], 0), fmt(s["compute_alone"]),
         fmt(1.1 * max(s["load_alone:" + tier], s["compute_alone"]))] for tier in TIERS if "load_alone:" + tier in s)))


def run(args: argparse.Namespace) -> int:
    settings, engine = load_engine(threads=args.threads, model={"name": args.model} if args.model else {})
    blend = engine.blend  # the settings' config, fitted to the model
    if args.ratio is not None:
        blend = dataclasses.replace(blend, recompute_ratio=args.ratio)
    variants = {spec: replace_spec(blend, spec) for spec in args.variant}
    items = json.loads(Path(args.data).read_text())[: args.questions]
    workdir = Path(tempfile.mkdtemp(prefix="ragblend-kv-bench-"))
    redis = None
    redis_url = args.redis_url
    if redis_url is None and shutil.which("redis-server"):
        redis = LocalRedis(workdir)
        redis_url = redis.url
    base = dataclasses.replace(settings.store, dtype=StorageDtype(args.dtype))
    throttles = {Tier(t): float(n) for t, n in (spec.split("=", 1) for spec in args.throttle_mbps)}
    stores = make_stores(engine.fingerprint, engine.kv_shape, base, workdir, redis_url, throttles)
    sink = engine.sink_ids(settings.blend.sink)
    try:
        fit_planners(engine, stores, blend, settings.store.planner_profile_tokens)
        warm_up = argparse.Namespace(**{**vars(args), "repeats": 1, "passages": 2})
        run_question(engine, stores, items[0], warm_up, blend, sink, variants)  # first calls are slow: not counted
        rows = [run_question(engine, stores, item, args, blend, sink, variants) for item in items]
    finally:
        for store in stores.values():
            store.close()
        if redis is not None:
            redis.close()
        shutil.rmtree(workdir, ignore_errors=True)
    summary = summarize(rows)
    summary.update(
        bench="kv", model=engine.model_name, device=str(engine.device), dtype=str(engine.dtype),
        storage_dtype=args.dtype, questions=len(rows), passages=args.passages, recompute_ratio=blend.recompute_ratio,
        cpu_threads=torch.get_num_threads(), machine=platform.machine(), has_redis=bool(redis_url),
        repeats=args.repeats, load_average=os.getloadavg()[0],
        page_cache="posix_fadvise(DONTNEED) per entry file before each disk run",
        min_recompute_ratio=base.min_recompute_ratio,
        throttle_mbps={t.value: r for t, r in throttles.items()},
    )
    print_table(summary)
    emit_summary(summary, args.out, default=float)
    return 0
