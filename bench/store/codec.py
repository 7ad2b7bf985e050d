"""`ragblend bench kv-codec`: bytes at rest per token, encode/decode speed and fidelity of each KV
entry format, on the real model's KV of dev-set passages.

Fidelity: for each question, the full prefill's greedy answer is the reference; each format's chunk
KV is written and read back (the tier's own codec round trip), blended with the same selection method
and ratio, and scored teacher-forced: KL(full || blend from that format), shown relative to blend from
float16 (the format before int4). Twice: each format's blend selecting on its own KV (what a user
gets: the selection moves with the KV's error), and under the float16 blend's selection ("same sel":
the format's error alone, the issue's measure). Prints a table, then one JSON object (also --out)."""

from __future__ import annotations

import argparse
import platform
import time
from dataclasses import dataclass, replace
from statistics import mean, median

import torch

from bench.harness.args import add_data, add_out
from bench.harness.engine import greedy_ids, prompt_for
from bench.harness.fidelity import argmax_agreement, mean_kl
from bench.harness.data import load_questions
from bench.harness.output import emit_summary
from blend_engine.engine import BlendEngine
from blend_engine.kv import ChunkKV
from blend_engine.types import PrefillMode, Segment
from configs.enums import SinkMode
from configs.settings import load_settings
from configs.enums import KVQuantization, StorageDtype
from kv_store import codec
from kv_store.keys import StorageFormat, chunk_key

FP16 = StorageFormat(StorageDtype.FLOAT16)


@dataclass(frozen=True)
class Candidate:
    name: str
    fmt: StorageFormat  # a storage format the store ships


def candidates() -> list[Candidate]:
    out = [Candidate("float16", FP16), Candidate("int8", StorageFormat(StorageDtype.FLOAT16, KVQuantization.INT8))]
    for q in KVQuantization:
        if q not in (KVQuantization.NONE, KVQuantization.INT8):
            out.append(Candidate(q.value, StorageFormat(StorageDtype.FLOAT16, q)))
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_data(parser, questions=10)
    parser.add_argument("--model", default=None, help="smollm2 (default), a HF dir, or random:<shape>")
    parser.add_argument("--answer-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--only", default=None,
                        help="comma-separated format names (or prefixes) to measure; float16, the reference, always")
    add_out(parser)


def _round_trip(kv: ChunkKV, cand: Candidate, sizes: dict, times: dict) -> ChunkKV:
    """Encode and decode the chunk as the tier would: its bytes and timings are added up per format."""
    t0 = time.perf_counter()
    key = chunk_key("bench", cand.fmt, kv.token_ids, kv.context_ids)
    blob = codec.encode(kv, key, "bench", cand.fmt)
    t1 = time.perf_counter()
    header = codec.read_header(blob, key, "bench", cand.fmt, kv.shape)
    out = codec.decode(header, lambda b, e: bytearray(blob[b:e]))
    t2 = time.perf_counter()
    payload = sum(header.layer_nbytes(i) for i in range(header.num_layers))
    sizes[cand.name] = sizes.get(cand.name, 0) + payload
    times.setdefault(cand.name, [0.0, 0.0])
    times[cand.name][0] += t1 - t0
    times[cand.name][1] += t2 - t1
    return ChunkKV(kv.token_ids, kv.context_ids, out.keys.to(kv.keys.dtype), out.values.to(kv.values.dtype))


def run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    overrides = {"model": {"name": args.model}} if args.model else {}
    settings = load_settings(None, **overrides)
    engine = BlendEngine.from_config(settings.model, settings.blend)
    questions = load_questions(args.data, args.questions, args.passages)
    cands = candidates()
    if args.only:
        wanted = [w.strip() for w in args.only.split(",") if w.strip()]
        cands = [c for c in cands if c.name == "float16" or any(c.name.startswith(w) for w in wanted)]
    sink = settings.blend.sink if isinstance(settings.blend.sink, SinkMode) else SinkMode(settings.blend.sink)
    blend = engine.blend
    sizes: dict[str, int] = {}
    times: dict[str, list[float]] = {}
    kls: dict[str, list[float]] = {c.name: [] for c in cands}
    same_kls: dict[str, list[float]] = {c.name: [] for c in cands}  # blend under float16's selection
    agree: dict[str, list[float]] = {c.name: [] for c in cands}
    num_tokens = 0
    is_quality = not engine.is_random
    for qi, question in enumerate(questions):
        t0 = time.perf_counter()
        segments = prompt_for(engine, question, sink, {})
        full = engine.prefill(segments, PrefillMode.FULL, blend, max_new_tokens=args.answer_tokens)
        ref_ids = greedy_ids(engine, full, args.answer_tokens) if is_quality else []
        ref_logits = engine.score(full, ref_ids) if ref_ids else None
        num_tokens += sum(s.kv.num_tokens for s in segments if isinstance(s.kv, ChunkKV))
        fp16_selection = None
        for cand in cands:  # float16 first: its selection is the one every format is also scored under
            trip = [Segment(s.token_ids, _round_trip(s.kv, cand, sizes, times)) if isinstance(s.kv, ChunkKV) else s
                    for s in segments]
            result = engine.prefill(trip, PrefillMode.BLEND, blend, max_new_tokens=args.answer_tokens)
            is_reference = fp16_selection is None
            if is_reference:
                fp16_selection = tuple(result.stats.selected_positions)
            if ref_ids:
                logits = engine.score(result, ref_ids)
                kls[cand.name].append(mean_kl(ref_logits, logits))
                agree[cand.name].append(argmax_agreement(logits, ref_ids))
                if not is_reference:  # float16 under its own selection is the blend just scored
                    same = replace(blend, selected_positions=fp16_selection)
                    result = engine.prefill(trip, PrefillMode.BLEND, same, max_new_tokens=args.answer_tokens)
                    logits = engine.score(result, ref_ids)
                same_kls[cand.name].append(mean_kl(ref_logits, logits))
        print(f"question {qi + 1}/{len(questions)} done in {time.perf_counter() - t0:.1f} s", flush=True)
    fp16_bytes = sizes["float16"] / num_tokens
    fp16_kl = mean(kls["float16"]) if kls["float16"] else None
    fp16_same_kl = mean(same_kls["float16"]) if same_kls["float16"] else None
    rows = []
    for cand in cands:
        bpt = sizes[cand.name] / num_tokens
        decoded_bytes = fp16_bytes * num_tokens  # what every format decodes to (fp16)
        kl = mean(kls[cand.name]) if kls[cand.name] else None
        rows.append({
            "format": cand.name, "is_shipped": True,
            "bytes_per_token": round(bpt, 1), "vs_float16": round(bpt / fp16_bytes, 4),
            "encode_mb_s": round(decoded_bytes / times[cand.name][0] / 1e6, 1),
            "decode_mb_s": round(decoded_bytes / times[cand.name][1] / 1e6, 1),
            "tf_kl": kl, "kl_vs_float16": (kl / fp16_kl) if kl is not None and fp16_kl else None,
            "median_kl": median(kls[cand.name]) if kls[cand.name] else None,
            "tf_agreement": mean(agree[cand.name]) if agree[cand.name] else None,
            "kl_per_question": kls[cand.name],
            # under float16's selection (the issue's "same selection"): the format's error alone
            "tf_kl_same_selection": mean(same_kls[cand.name]) if same_kls[cand.name] else None,
            "kl_same_selection_vs_float16": (mean(same_kls[cand.name]) / fp16_same_kl) if same_kls[cand.name]
            and fp16_same_kl else None,
            "kl_same_selection_per_question": same_kls[cand.name],
        })
    summary = {
        "bench": "kv-codec", "model": settings.model.name, "questions": len(questions), "passages": args.passages,
        "chunk_tokens": num_tokens, "recompute_ratio": blend.recompute_ratio, "selection": str(blend.selection.value),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(), "threads": torch.get_num_threads(),
        "rows": rows,
    }
    print(f"{'format':44s} {'B/token':>9s} {'x fp16':>7s} {'enc MB/s':>9s} {'dec MB/s':>9s} {'TF KL':>8s} {'KL/fp16':>8s} "
          f"{'same sel':>8s} {'TF agr':>7s}")
    for r in rows:
        kl = f"{r['tf_kl']:.4f}" if r["tf_kl"] is not None else "-"
        rel = f"{r['kl_vs_float16']:.3f}" if r["kl_vs_float16"] is not None else "-"
        agr = f"{r['tf_agreement']:.3f}" if r["tf_agreement"] is not None else "-"
        same = f"{r['kl_same_selection_vs_float16']:.3f}" if r["kl_same_selection_vs_float16"] is not None else "-"
        print(f"{r['format']:44s} {r['bytes_per_token']:9.0f} {r['vs_float16']:7.3f} {r['encode_mb_s']:9.0f} "
              f"{r['decode_mb_s']:9.0f} {kl:>8s} {rel:>8s} {same:>8s} {agr:>7s}")
    emit_summary(summary, args.out)
    return 0
