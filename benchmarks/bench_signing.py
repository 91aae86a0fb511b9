"""Sign + verify of one frame, per HMAC-SHA256 construction, with warm and with cold CPU caches.

A cell signs and verifies a few small frames on its critical path (the request, the reply),
usually after the notebook sat idle, so the caches are cold. Each variant signs a frame and
verifies it (a second signature and a compare), as `Signer.pack` and `Signer.verify` do:
- `_sha2 states`: HMAC built from two keyed states of CPython's private `_sha2.sha256`, copied
  per frame (what `wire/signing.py` did until 2026-12-02);
- `hmac.copy`: `hmac.new(key, digestmod="sha256")` made once, `.copy()` per frame;
- `hmac.digest`: `hmac.digest(key, payload, "sha256")`, OpenSSL's one-shot HMAC;
- `hashlib states`: HMAC built from two keyed `hashlib.sha256` states, copied per frame.
Cold: before each frame, 64 MiB are written to push the code and data of the last one out of
the caches (that write is not timed). Variants take turns, so all see the same machine.
Run: .venv/bin/python benchmarks/bench_signing.py [--rounds 3000] [--payload-bytes 200]
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import statistics
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fsdp2nb.wire.signing import KEY_BYTES, Signer

SignAndVerify = Callable[[bytes], bool]


def keyed_states(key: bytes, sha256: Callable[..., object]) -> SignAndVerify:
    padded = key.ljust(64, b"\0")
    inner_state = sha256(bytes(byte ^ 0x36 for byte in padded))
    outer_state = sha256(bytes(byte ^ 0x5C for byte in padded))

    def sign(payload: bytes) -> bytes:
        inner = inner_state.copy()
        inner.update(payload)
        outer = outer_state.copy()
        outer.update(inner.digest())
        return outer.digest()

    return lambda payload: hmac.compare_digest(sign(payload), sign(payload))


def sha2_states(key: bytes) -> SignAndVerify:
    try:
        import _sha2  # Python 3.12+
    except ImportError:
        import _sha256 as _sha2  # 3.10-3.11
    return keyed_states(key, _sha2.sha256)


def hmac_copy(key: bytes) -> SignAndVerify:
    keyed = hmac.new(key, digestmod="sha256")

    def sign(payload: bytes) -> bytes:
        mac = keyed.copy()
        mac.update(payload)
        return mac.digest()

    return lambda payload: hmac.compare_digest(sign(payload), sign(payload))


def hmac_digest(key: bytes) -> SignAndVerify:
    return lambda payload: hmac.compare_digest(hmac.digest(key, payload, "sha256"),
                                               hmac.digest(key, payload, "sha256"))


def hashlib_states(key: bytes) -> SignAndVerify:
    return keyed_states(key, hashlib.sha256)


VARIANTS = {"_sha2 states": sha2_states, "hmac.copy": hmac_copy, "hmac.digest": hmac_digest,
            "hashlib states": hashlib_states}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3000)
    parser.add_argument("--payload-bytes", type=int, default=200)
    args = parser.parse_args()
    key = os.urandom(KEY_BYTES)
    payload = os.urandom(args.payload_bytes)
    runs = {name: make(key) for name, make in VARIANTS.items()}
    frame = Signer(key).pack(payload)  # a payload that is no wire message is pickled as (None, it)
    assert frame[:32] == hmac.digest(key, frame[32:], "sha256"), "the tree's Signer is not HMAC-SHA256"
    assert all(run(payload) for run in runs.values())
    evict = bytearray(64 * 1024 * 1024)
    times: dict[str, dict[str, list[float]]] = {"warm": {n: [] for n in runs}, "cold": {n: [] for n in runs}}
    for round_index in range(args.rounds):
        order = list(runs.items())
        for name, run in order[round_index % len(order):] + order[:round_index % len(order)]:
            run(payload)  # warm
            started = time.perf_counter_ns()
            run(payload)
            times["warm"][name].append(time.perf_counter_ns() - started)
            evict[::64] = bytes(len(evict) // 64)  # one write per cache line
            started = time.perf_counter_ns()
            run(payload)
            times["cold"][name].append(time.perf_counter_ns() - started)
    print(f"sign + verify of a {args.payload_bytes}-byte frame, median of {args.rounds} (µs)")
    print(f"{'variant':>15} {'warm':>7} {'cold':>7}")
    for name in runs:
        warm, cold = (statistics.median(times[kind][name]) / 1000 for kind in ("warm", "cold"))
        print(f"{name:>15} {warm:7.2f} {cold:7.2f}")


if __name__ == "__main__":
    main()
