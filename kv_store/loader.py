"""Layer sources over stored chunks: the engine's `LayerKVSource`, read synchronously or pipelined.

Pipelined, a reader thread loads layer i+1.. (all chunks) while the engine computes layer i. A
chunk that fails there is never recomputed on that thread (that would run a forward beside the
engine's own): the thread stops and the engine's thread loads, and recovers, from that layer on. Torch
ops and file reads release the GIL, so the reads overlap the compute. On CUDA the thread reads
into pinned buffers and copies on a side stream; the engine's stream waits on a per-layer event,
so there is no device-wide synchronize. An int8 entry's layer is moved as int8 (with its scales) and
dequantized on the target device: half the bytes of fp16 cross PCIe. A disk layer's K and V are one
block, moved in one copy.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from blend_engine.types import Segment
from blend_engine.threads import lower_to_idle_priority, pin_one_thread
from kv_store.backend import LayerReader, Tier
from kv_store.codec import EncodedLayer
from kv_store.entry import OpenEntry, ReadResult, read_many
from kv_store.errors import CorruptEntryError, EntryLostError

log = logging.getLogger(__name__)

LayerPairs = list[tuple[torch.Tensor, torch.Tensor]]  # per chunk: keys, values [H, n, D]
# Called when a chunk's reader fails mid-request: returns a reader over fresh KV, or raises.
RecoverFn = Callable[[int, Exception], LayerReader]


class _RecoveryNeeded(Exception):
    """The reader thread met a damaged or lost chunk; the engine's thread must recompute it."""


@dataclass(frozen=True)
class StoredChunk:
    """A store handle: what the prefill needs before the chunk's layers arrive (a `CachedChunk`)."""

    key: str
    tier: Tier
    token_ids: tuple[int, ...]
    context_ids: tuple[int, ...]
    num_layers: int
    layer_nbytes: int  # stored bytes per layer
    # The entry opened by `handle` (or the prefetch): its reader and the layers read so far, so the
    # request never opens or reads the entry again. None on the memory tier (reads are views).
    entry: OpenEntry | None = field(default=None, compare=False, repr=False)
    salt: str = ""  # the collection's KV salt its key was made with (kv_store/keys.py)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def handles_in(segments: Sequence[Segment]) -> list[StoredChunk]:
    """The store handles among a prompt's segments, in prompt order: the order a layer source must load
    them in (the engine takes its layers "for the non-ChunkKV segments, in prompt order"), which is not
    the caller's chunk order when the prompt builder reorders chunks (ModelConfig.chunk_order)."""
    return [s.kv for s in segments if isinstance(s.kv, StoredChunk)]


@dataclass
class SourceStats:
    """Per-request loading figures (mutable: filled while the request runs)."""

    num_layers_loaded: int = 0
    num_bytes_loaded: int = 0
    load_seconds: float = 0.0  # time spent reading (in the thread when pipelined)
    wait_seconds: float = 0.0  # time the engine blocked in layer()
    num_recovered: int = 0  # chunks whose entry failed mid-request and were recomputed


class StoreLayerSource:
    """`LayerKVSource` over per-chunk readers. Call `close()` when the prefill is done."""

    def __init__(
        self,
        readers: Sequence[LayerReader],
        device: torch.device | str,
        dtype: torch.dtype,
        recover: RecoverFn,
        is_pipelined: bool = True,
        prefetch_depth: int = 2,
        start_layer: int = 0,
        is_loader_idle: bool = False,
    ):
        self._readers = list(readers)
        self._device, self._dtype = torch.device(device), dtype
        self._recover = recover
        self._num_layers = self._readers[0].info.num_layers if self._readers else 0
        self._is_cuda = self._device.type == "cuda"
        self._side_stream = torch.cuda.Stream(self._device) if (self._is_cuda and is_pipelined) else None
        self.stats = SourceStats()
        self._cond = threading.Condition()
        self._ready: dict[int, tuple[LayerPairs, torch.cuda.Event | None]] = {}  # prefetched layers
        self._wanted = start_layer  # the layer the engine asked for last
        self._error: BaseException | None = None  # what stopped the reader thread, raised to the engine
        self._sync_from: int | None = None  # the layer where the thread met a failed chunk and stopped
        self._is_closed = False
        self._thread: threading.Thread | None = None
        self._start_layer, self._prefetch_depth = start_layer, prefetch_depth
        self._is_loader_idle = is_loader_idle
        if is_pipelined and self._readers:
            self._thread = threading.Thread(target=self._prefetch, name="kv-prefetch", daemon=True)
            self._thread.start()

    @property
    def is_pipelined(self) -> bool:
        """Whether a reader thread prefetches layers ahead of the engine."""
        return self._thread is not None

    # --- the engine's side ------------------------------------------------------------------------
    def layer(self, layer_idx: int) -> LayerPairs:
        if not 0 <= layer_idx < self._num_layers and self._readers:
            raise IndexError(f"layer {layer_idx} of {self._num_layers}")
        start = time.perf_counter()
        taken = None
        if self._thread is not None and layer_idx >= self._start_layer:
            taken = self._take(layer_idx)
        pairs, event = taken if taken is not None else self._load(layer_idx, may_recover=True)
        if event is not None:  # the copy ran on the side stream: order the engine's stream after it
            stream = torch.cuda.current_stream(self._device)
            stream.wait_event(event)
            for k, v in pairs:
                k.record_stream(stream)
                v.record_stream(stream)
        self.stats.wait_seconds += time.perf_counter() - start
        return pairs

    def _take(self, layer_idx: int) -> tuple[LayerPairs, torch.cuda.Event | None] | None:
        with self._cond:
            if layer_idx < self._wanted:
                raise ValueError(f"layers must be asked in increasing order: {layer_idx} after {self._wanted}")
            self._wanted = layer_idx
            for old in [i for i in self._ready if i < layer_idx]:
                del self._ready[old]  # skipped by the engine
            self._cond.notify_all()
            while layer_idx not in self._ready:
                if self._error is not None:  # the thread stopped before reaching this layer
                    raise self._error
                if self._sync_from is not None:  # the thread stopped at a failed chunk: load here
                    return None
                self._cond.wait()
            result = self._ready.pop(layer_idx)
            self._cond.notify_all()
        return result  # type: ignore[return-value]

    # --- the reader thread ------------------------------------------------------------------------
    def _prefetch(self) -> None:
        pin_one_thread()  # it starts inside the engine's job: without this it would take the job's count
        if self._is_loader_idle and not lower_to_idle_priority():  # the engine's threads first (decision 0017)
            log.debug("the KV reader thread keeps the server's CPU priority: this platform has no SCHED_IDLE for it")
        layer_idx = self._start_layer
        while layer_idx < self._num_layers:
            with self._cond:
                while not self._is_closed and layer_idx - self._wanted > self._prefetch_depth:
                    self._cond.wait()
                if self._is_closed:
                    return
                layer_idx = max(layer_idx, self._wanted)  # the engine skipped ahead
            try:
                result = self._load(layer_idx, may_recover=False)
            except _RecoveryNeeded:  # recomputing is engine work: the engine's thread does it (in layer())
                with self._cond:
                    self._sync_from = layer_idx
                    self._cond.notify_all()
                return
            except BaseException as exc:  # handed to the engine's thread, raised there
                with self._cond:
                    self._error = exc
                    self._cond.notify_all()
                return
            with self._cond:
                self._ready[layer_idx] = result
                self._cond.notify_all()
            layer_idx += 1

    def _load(self, layer_idx: int, may_recover: bool) -> tuple[LayerPairs, torch.cuda.Event | None]:
        start = time.perf_counter()
        host = self._read_all(layer_idx, may_recover)
        event = None
        if self._side_stream is not None:
            with torch.cuda.stream(self._side_stream):
                pairs = [self._convert(layer) for layer in host]
                event = torch.cuda.Event()
                event.record(self._side_stream)
        else:
            pairs = [self._convert(layer) for layer in host]
        self.stats.num_layers_loaded += 1
        self.stats.num_bytes_loaded += sum(r.info.layer_nbytes for r in self._readers)
        self.stats.load_seconds += time.perf_counter() - start
        return pairs, event

    def _read_all(self, layer_idx: int, may_recover: bool) -> list[EncodedLayer]:
        """Layer `layer_idx` of every chunk; the open entries' reads go out together, one per tier."""
        opened = [i for i, r in enumerate(self._readers) if isinstance(r, OpenEntry)]
        reads = [(self._readers[i], layer_idx) for i in opened]
        batched = dict(zip(opened, read_many(reads, pinned=self._side_stream is not None)))  # type: ignore[arg-type]
        return [self._read(i, layer_idx, may_recover, batched.get(i)) for i in range(len(self._readers))]

    def _read(self, chunk_idx: int, layer_idx: int, may_recover: bool,
              batched: ReadResult | None = None) -> EncodedLayer:
        try:
            if batched is None:
                return self._readers[chunk_idx].read_layer_encoded(layer_idx, pinned=self._side_stream is not None)
            if isinstance(batched, Exception):
                raise batched
            return batched
        except (CorruptEntryError, EntryLostError) as exc:
            if not may_recover:
                raise _RecoveryNeeded() from exc
            log.warning("chunk %d failed at layer %d (%s): recomputing it", chunk_idx, layer_idx, exc)
            self._readers[chunk_idx].close()
            self._readers[chunk_idx] = self._recover(chunk_idx, exc)
            self.stats.num_recovered += 1
            return self._readers[chunk_idx].read_layer_encoded(layer_idx)

    def _convert(self, layer: EncodedLayer) -> tuple[torch.Tensor, torch.Tensor]:
        # non_blocking only matters for a pinned host tensor on the side stream
        non_blocking = self._side_stream is not None
        if isinstance(layer, tuple):  # separate tensors (the GPU tier's views, a recomputed chunk)
            k, v = layer
            return (k.to(self._device, non_blocking=non_blocking).to(self._dtype),
                    v.to(self._device, non_blocking=non_blocking).to(self._dtype))
        # packed as stored: one copy per chunk-layer (K and V together; int8 stays int8), unpacked there
        k, v = layer.to(self._device, non_blocking).unpack()
        return k.to(self._dtype), v.to(self._dtype)

    def close(self) -> None:
        with self._cond:
            self._is_closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        for reader in self._readers:
            reader.close()
        self._readers = []
        self._ready.clear()
