"""Concurrency: threads sharing a store, and two processes writing the same key to one directory."""

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import torch

from blend_engine.kv import ChunkKV, KVShape
from configs.enums import KVQuantization, StorageDtype
from kv_store import KVStore, StoreConfig, Tier

FP = "fingerprint-c"
ROOT = Path(__file__).resolve().parents[1]


def random_kv(seed: int, num_tokens=24) -> ChunkKV:
    g = torch.Generator().manual_seed(seed)
    shape = (2, 2, num_tokens, 8)
    return ChunkKV(tuple(range(seed, seed + num_tokens)), (), torch.randn(shape, generator=g), torch.randn(shape, generator=g))


def make_store(root: Path, shape: KVShape = KVShape(2, 2, 8), **kw) -> KVStore:  # random_kv's shape
    kw.setdefault("quantization", KVQuantization.NONE)
    return KVStore(FP, StoreConfig(dtype=StorageDtype.FLOAT32, disk_dir=root, fsync=False, **kw), shape=shape)


def test_threads_put_get_same_and_different_keys(tmp_path):
    kvs = [random_kv(seed) for seed in range(6)]
    size = kvs[0].nbytes
    # small bounds so evictions race with reads too
    store = make_store(tmp_path / "kv", max_memory_bytes=3 * size, max_disk_bytes=4 * (size + 4096))
    keys = [store.key_for(kv.token_ids, kv.context_ids) for kv in kvs]
    errors: list[str] = []
    num_hits = [0]

    def worker(worker_idx: int) -> None:
        for step in range(40):
            idx = (worker_idx + step) % len(kvs) if worker_idx % 2 else step % 2  # half hammer keys 0/1
            store.put(keys[idx], kvs[idx])
            out = store.get(keys[idx])
            if out is None:
                continue  # evicted by another thread between put and get: allowed
            num_hits[0] += 1
            if not (torch.equal(out.keys, kvs[idx].keys) and torch.equal(out.values, kvs[idx].values)):
                errors.append(f"torn read of {idx} in worker {worker_idx}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and num_hits[0] > 100
    assert not list((tmp_path / "kv" / "tmp").iterdir()), "no partial files left"
    mem, disk = store.backend(Tier.MEMORY), store.backend(Tier.DISK)
    assert mem.bytes_used() <= mem.max_bytes and disk.bytes_used() <= disk.max_bytes
    on_disk = list((tmp_path / "kv").glob("??/*.safetensors"))
    assert sum(f.stat().st_size for f in on_disk) <= disk.max_bytes
    fresh = make_store(tmp_path / "kv", max_memory_bytes=0)
    for f in on_disk:  # every file left is a whole, valid entry
        key = f.name.split(".")[0]
        assert torch.equal(fresh.get(key).keys, kvs[keys.index(key)].keys)


WRITER = textwrap.dedent(
    """
    import sys, torch
    from pathlib import Path
    from blend_engine.kv import ChunkKV, KVShape
    from configs.enums import KVQuantization, StorageDtype
    from kv_store import KVStore, StoreConfig, Tier
    g = torch.Generator().manual_seed(7)
    kv = ChunkKV(tuple(range(500)), (), torch.randn(4, 2, 500, 32, generator=g), torch.randn(4, 2, 500, 32, generator=g))
    store = KVStore("fingerprint-c", StoreConfig(dtype=StorageDtype.FLOAT32, disk_dir=Path(sys.argv[1]),
                    max_memory_bytes=0, fsync=False, quantization=KVQuantization.NONE), shape=KVShape(4, 2, 32))
    key = store.key_for(kv.token_ids, ())
    disk = store.backend(Tier.DISK)
    for _ in range(25):
        disk.delete(key)  # force a real rewrite each time
        store.put(key, kv)
    print(key)
    """
)


def test_two_processes_writing_same_key_leave_one_valid_file(tmp_path):
    root = tmp_path / "kv"
    procs = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(root)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    # Meanwhile read in this process: every successful read must be whole (checksums hold).
    g = torch.Generator().manual_seed(7)
    expected = torch.randn(4, 2, 500, 32, generator=g)
    reader = make_store(root, KVShape(4, 2, 32), max_memory_bytes=0)  # the writers' chunk
    key = reader.key_for(tuple(range(500)), ())
    while any(p.poll() is None for p in procs):
        out = reader.backend(Tier.DISK).get(key)
        assert out is None or torch.equal(out.keys, expected)
        time.sleep(0.002)  # leave the two cores to the writers
    outputs = [p.communicate()[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs) and outputs == [key, key]
    files = list(root.glob("??/*.safetensors"))
    assert [f.name.split(".")[0] for f in files] == [key]
    assert not list((root / "tmp").iterdir())
    assert reader.stats().tiers["disk"].corrupt == 0
    assert torch.equal(make_store(root, KVShape(4, 2, 32), max_memory_bytes=0).get(key).keys, expected)
