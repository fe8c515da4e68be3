"""The verdict on a weight push from what every vLLM worker read back at its end
(services/rollout/readback.py): the digest of each tensor as the engine holds it, or an error
naming every tensor the engine does not compute with as it was given.

Each worker reports, for every tensor the push handed to vLLM, the digest of what it was given
(the bytes received, or for an adapter push the merged weights it computed) and its share of the
digest of what its model now holds; the shares add up, across tensor-parallel workers, to the
digest of the whole tensor. A tied head is compared with the tensor it is tied to.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from services.rollout.readback import ReadBack, Sums, digest_bytes


def report_of(held: ReadBack, loaded: Mapping[str, list], reload_warnings: Sequence[str]) -> dict:
    """What a worker returns at a push's end (plain lists and strings: it crosses vLLM's RPC).
    loaded: name -> [hex digest, dtype name, shape] of every tensor the push handed to vLLM."""
    return {"loaded": dict(loaded), "tied": held.tied, "unverified": held.unverified, "shared": held.shared,
            "held": {name: [digest_bytes(s.a, s.b).hex(), s.count] for name, s in held.sums.items()},
            "reload_warnings": list(reload_warnings)}


class HeldWeightsError(RuntimeError):
    """The engine does not compute with the weights it was given (the message names them)."""


def held_digests(reports: Sequence[dict], engine: str) -> tuple[dict[str, str], dict[str, str]]:
    """From every worker's report of a push's end: (name -> hex digest of what the engine holds, for
    every tensor it was given; name -> why it could not be read back). A tensor not read back is
    taken as given. Raises HeldWeightsError naming every tensor the engine holds otherwise, and
    every tied head that differs from its tensor."""
    loaded = reports[0]["loaded"]
    for rank, report in enumerate(reports[1:], start=1):
        if report["loaded"] != loaded:
            raise RuntimeError(f"worker {rank} was given other tensors than worker 0")
    totals: dict[str, Sums] = {}
    unverified: dict[str, str] = {}
    for report in reports:
        unverified.update(report["unverified"])
        for name, (digest, count) in report["held"].items():
            part = bytes.fromhex(digest)
            total = totals.setdefault(name, Sums())
            total.a = (total.a + int.from_bytes(part[:8], "little")) % 2 ** 64
            total.b = (total.b + int.from_bytes(part[8:], "little")) % 2 ** 64
            total.count += count
    wrong: list[str] = []
    held: dict[str, str] = {}

    def check(name: str, expected: str, numel: int, what: str) -> None:
        total = totals.get(name, Sums())
        held[name] = digest_bytes(total.a, total.b).hex()
        if total.count != numel:
            wrong.append(f"{name} (its shares on the workers cover {total.count} of its {numel} elements)")
        elif held[name] != expected:
            wrong.append(f"{name} ({what})")

    for name, (digest, _, shape) in loaded.items():
        if name in unverified:
            held[name] = digest
            continue
        others = reports[0]["shared"].get(name)
        check(name, digest, _numel(shape), "holds other values than it was given" + (
            f"; the engine keeps it in one tensor with {', '.join(others)}, which it was given too" if others else ""))
    for head, target in reports[0]["tied"].items():
        if target in loaded and head not in unverified:
            check(head, loaded[target][0], _numel(loaded[target][2]), f"tied to {target}, holds other values")
    if wrong:
        said = sorted({w for report in reports for w in report.get("reload_warnings", []) if "Failed" in w})
        raise HeldWeightsError(
            f"{engine} does not compute with the weights it was given: {len(wrong)} tensors read back differ, "
            f"{'; '.join(wrong[:8])}{' ...' if len(wrong) > 8 else ''}"
            f"{' (vLLM said while loading: ' + '; '.join(said) + ')' if said else ''}. Each was compared with "
            "what this engine received (or computed, for an adapter), so the difference comes from loading them, "
            "not from the transfer: the engine would sample from other weights than the learner's")
    return {name: held[name] for name in loaded}, unverified


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
