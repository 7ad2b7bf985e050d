"""The prefix cache's tree (kv_store/prefix_cache.py): the longest kept prefix, LRU eviction within the
byte bound, namespaces and kinds kept apart, invalidation by chunk key, against a brute-force reference
on random prompts."""

from __future__ import annotations

import random
import threading

import pytest

from kv_store.prefix_cache import PrefixCache


def insert(cache: PrefixCache, ids, value=None, nbytes: int = 10, keys=(), namespace: str = "", kind: str = "k",
           epoch: int | None = None):
    return cache.insert(namespace, kind, tuple(ids), value if value is not None else tuple(ids), nbytes, keys, epoch)


def test_the_longest_kept_prefix_is_found_whole_or_in_part():
    cache = PrefixCache(1000)
    insert(cache, [1, 2, 3, 4, 5])
    insert(cache, [1, 2, 3, 9])
    insert(cache, [7, 8])
    whole = cache.lookup("", ["k"], [1, 2, 3, 4, 5])
    assert whole.is_whole and whole.num_tokens == 5 and whole.entry.value == (1, 2, 3, 4, 5)
    longer = cache.lookup("", ["k"], [1, 2, 3, 4, 5, 6, 7])  # a follow-up: the kept prompt, then more
    assert not longer.is_whole and longer.num_tokens == 5 and longer.entry.value == (1, 2, 3, 4, 5)
    parted = cache.lookup("", ["k"], [1, 2, 3, 9, 4])
    assert parted.num_tokens == 4 and parted.entry.value == (1, 2, 3, 9)
    shorter = cache.lookup("", ["k"], [1, 2, 3, 4])  # a prefix of a kept prompt: its tokens, not its logits
    assert not shorter.is_whole and shorter.num_tokens == 4 and shorter.entry.value == (1, 2, 3, 4, 5)
    mid = cache.lookup("", ["k"], [1, 2, 5])
    assert mid.num_tokens == 2 and mid.entry.value in {(1, 2, 3, 4, 5), (1, 2, 3, 9)}
    assert cache.lookup("", ["k"], [2, 1]) is None and cache.lookup("", ["k"], []) is None
    insert(cache, [1, 2, 3])  # a kept prompt ending inside another's edge
    assert cache.lookup("", ["k"], [1, 2, 3]).is_whole and cache.lookup("", ["k"], [1, 2, 3]).entry.value == (1, 2, 3)


def test_random_prompts_match_a_brute_force_longest_prefix():
    rng = random.Random(0)
    cache, kept = PrefixCache(10**9), []
    for _ in range(200):
        base = rng.choice(kept) if kept and rng.random() < 0.7 else ()
        ids = tuple(base[: rng.randint(0, len(base))]) + tuple(rng.randrange(4) for _ in range(rng.randint(1, 6)))
        insert(cache, ids)
        if ids not in kept:
            kept.append(ids)
        query = tuple(rng.randrange(4) for _ in range(rng.randint(1, 12)))
        if rng.random() < 0.5:
            query = rng.choice(kept)[: rng.randint(1, 12)] + query[: rng.randint(0, 3)]
        best = max((next((i for i, (a, b) in enumerate(zip(k, query)) if a != b), min(len(k), len(query))), k)
                   for k in kept)
        match = cache.lookup("", ["k"], query)
        if best[0] == 0:
            assert match is None
            continue
        assert match.num_tokens == best[0], (query, match.entry.token_ids)
        assert match.entry.token_ids[: match.num_tokens] == query[: match.num_tokens]
        assert match.is_whole == (query in kept)
    assert len(cache) == len(kept) and cache.bytes_used == 10 * len(kept)


def test_least_recently_used_entries_go_first_within_the_byte_bound():
    cache = PrefixCache(100)
    for first in range(3):
        assert insert(cache, [first, 1, 2], nbytes=30)
    cache.lookup("", ["k"], [0, 1, 2])  # used: now the most recent
    assert insert(cache, [3, 1, 2], nbytes=30)  # 120 > 100: the least recently used (1, ...) goes
    assert cache.lookup("", ["k"], [1, 1, 2]) is None
    assert {cache.lookup("", ["k"], [i, 1, 2]).num_tokens for i in (0, 2, 3)} == {3}
    assert cache.bytes_used == 90 and len(cache) == 3 and cache.stats().evictions == 1
    assert insert(cache, [4], nbytes=100)  # takes the whole bound: every other entry goes
    assert len(cache) == 1 and cache.bytes_used == 100 and cache.stats().evictions == 4
    assert not insert(cache, [5], nbytes=101)  # larger than the bound: not kept, nothing evicted
    assert len(cache) == 1 and cache.lookup("", ["k"], [5]) is None
    assert insert(cache, [4], value="new", nbytes=40)  # the same prompt again: replaced, counted once
    assert cache.lookup("", ["k"], [4]).entry.value == "new" and cache.bytes_used == 40 and len(cache) == 1


def test_a_disabled_cache_keeps_nothing():
    cache = PrefixCache(0)
    assert not cache.is_enabled and not insert(cache, [1, 2], nbytes=1) and cache.lookup("", ["k"], [1, 2]) is None


def test_namespaces_and_kinds_never_meet():
    cache = PrefixCache(1000)
    insert(cache, [1, 2, 3], value="a", namespace="kb-a")
    insert(cache, [1, 2, 3], value="b", namespace="kb-b")
    insert(cache, [1, 2, 3, 4], value="blend", namespace="kb-a", kind="blend/None/None")
    assert cache.lookup("kb-a", ["k"], [1, 2, 3]).entry.value == "a"
    assert cache.lookup("kb-b", ["k"], [1, 2, 3]).entry.value == "b"
    assert cache.lookup("", ["k"], [1, 2, 3]) is None and cache.lookup("kb-c", ["k"], [1, 2, 3]) is None
    assert cache.lookup("kb-a", ["blend/0.3/None"], [1, 2, 3, 4]) is None
    # a request that may use both kinds gets the whole match first, then the longest
    assert cache.lookup("kb-a", ["k", "blend/None/None"], [1, 2, 3, 4]).entry.value == "blend"
    assert cache.lookup("kb-a", ["k", "blend/None/None"], [1, 2, 3]).entry.value == "a"
    assert cache.lookup("kb-b", ["k", "blend/None/None"], [1, 2, 3, 4]).entry.value == "b"


def test_a_changed_chunk_drops_every_prompt_holding_it():
    cache = PrefixCache(1000)
    insert(cache, [1, 2], keys={"c1", "c2"})
    insert(cache, [1, 3], keys={"c2"})
    insert(cache, [4], keys={"c3"}, namespace="other")
    insert(cache, [5], keys=())
    assert cache.invalidate_chunks({"c2", "zz"}) == 2
    assert cache.lookup("", ["k"], [1, 2]) is None and cache.lookup("", ["k"], [1, 3]) is None
    assert cache.lookup("other", ["k"], [4]).is_whole and cache.lookup("", ["k"], [5]).is_whole
    assert cache.invalidate_chunks(()) == 0
    live = {"c3"}
    assert cache.retain_live(lambda key: key in live) == 0  # [5] holds no chunk, [4] a live one
    live.clear()
    assert cache.retain_live(lambda key: key in live) == 1
    assert cache.lookup("other", ["k"], [4]) is None and len(cache) == 1 and cache.bytes_used == 10
    assert cache.stats().invalidations == 3


def test_record_counts_hits_partial_hits_misses_and_tokens():
    cache = PrefixCache(1000)
    insert(cache, [1, 2, 3])
    cache.record(cache.lookup("", ["k"], [1, 2, 3]), 3)
    cache.record(cache.lookup("", ["k"], [1, 2, 3, 4]), 3)
    cache.record(cache.lookup("", ["k"], [1, 2, 9]), 0)  # matched, but nothing reused: a miss
    cache.record(cache.lookup("", ["k"], [9]))
    stats = cache.stats()
    assert (stats.hits, stats.partial_hits, stats.misses, stats.tokens_served) == (1, 1, 2, 6)
    assert (stats.num_entries, stats.bytes_used, stats.max_bytes, stats.insertions) == (1, 10, 1000, 1)


def test_concurrent_inserts_lookups_and_invalidations_keep_the_books():
    cache, errors = PrefixCache(2000), []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(300):
                ids = tuple(rng.randrange(3) for _ in range(rng.randint(1, 5)))
                if rng.random() < 0.5:
                    insert(cache, ids, nbytes=rng.randint(1, 100), keys={f"c{rng.randrange(5)}"})
                elif rng.random() < 0.8:
                    match = cache.lookup("", ["k"], ids)
                    assert match is None or match.entry.token_ids[: match.num_tokens] == ids[: match.num_tokens]
                else:
                    cache.invalidate_chunks({f"c{rng.randrange(5)}"})
        except Exception as exc:  # handed to the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert cache.bytes_used <= 2000 and cache.bytes_used == sum(e.nbytes for e in cache._entries)
    num_entries = len(cache)
    assert cache.clear() == num_entries and len(cache) == 0
    assert cache.bytes_used == 0 and not cache._roots


def test_an_empty_prompt_or_a_negative_bound_is_refused():
    with pytest.raises(ValueError, match="max_bytes"):
        PrefixCache(-1)
    with pytest.raises(ValueError, match="empty prompt"):
        insert(PrefixCache(10), [])


def test_a_prompt_whose_chunk_changed_while_it_was_prefilled_is_not_kept():
    cache = PrefixCache(1000)
    epoch = cache.epoch  # its chunks are chosen
    cache.invalidate_chunks({"c1"})  # their document changes meanwhile
    assert not insert(cache, [1, 2], keys={"c1", "c2"}, epoch=epoch) and len(cache) == 0
    assert insert(cache, [1, 3], keys={"c2"}, epoch=epoch)  # another chunk's prompt: kept
    assert insert(cache, [1, 2], keys={"c1", "c2"}, epoch=cache.epoch)  # chosen after the change: kept
    assert insert(cache, [1, 4], keys={"c1"})  # no epoch given: kept
