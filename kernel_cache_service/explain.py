"""Why a program key misses: the part-by-part difference between the parts record a key wants and
those of the stored entries of the same name (``warmserve cache explain``, the runner's MISS line;
``docs/architecture.md`` §5).

A record is compared leaf by leaf: a leaf is a value that is not a JSON object (a list counts as
one value), named by its path, dict keys joined by ``.`` and a key holding ``.`` or ``[`` written
``[key]`` (``compile_options.threads``, ``sources[runner_service.programs.key]``). An entry's
stored record is used only when its :func:`~kernel_cache_service.fingerprint.fingerprint_of` is
the entry's fingerprint (else it is treated as absent), so an explanation never rests on a
record that does not belong to the key.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kernel_cache_service.entry import EntryInfo
from kernel_cache_service.fingerprint import fingerprint_of, parse_parts

#: Stands for a leaf one of the two records lacks.
ABSENT = "(absent)"
#: The nearest entries an explanation names by default.
DEFAULT_NEAREST = 3
#: Characters of a value shown in the one-line summary (JSON; longer ones are cut with "...").
_SHORT_VALUE = 40
#: Differences the one-line summary names (then "and N more parts").
_SHORT_COUNT = 4


@dataclass(frozen=True)
class Difference:
    """One differing leaf: ``path`` (see the module docstring), ``stored`` (the entry's value) and
    ``wanted`` (the key's), each a JSON value or :data:`ABSENT`."""

    path: str
    stored: object
    wanted: object

    def to_dict(self) -> dict:
        """``{"part", "stored", "wanted"}`` (JSON-ready)."""
        return {"part": self.path, "stored": self.stored, "wanted": self.wanted}


@dataclass(frozen=True)
class Neighbour:
    """A stored entry of the wanted name and how its record differs from the wanted one."""

    entry: EntryInfo
    differences: tuple[Difference, ...]

    def to_dict(self) -> dict:
        """The entry's fingerprint, creation time, producer and differences (JSON-ready)."""
        return {"fingerprint": self.entry.fingerprint, "created_unix_s": self.entry.created,
                "producer": self.entry.producer, "differences": [d.to_dict() for d in self.differences]}


@dataclass(frozen=True)
class Explanation:
    """What :func:`explain` found for ``name``/``fingerprint``: ``hit`` (the store holds it),
    ``nearest`` (entries of the name with a usable record, fewest differences first, then the
    newest), ``without_parts`` (fingerprints of entries of the name that carry no usable record:
    published by an older warmserve, or a record that does not match its key)."""

    name: str
    fingerprint: str
    hit: bool
    nearest: tuple[Neighbour, ...] = ()
    without_parts: tuple[str, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict:
        """Every field (JSON-ready: ``cache explain --json`` prints it)."""
        return {"name": self.name, "fingerprint": self.fingerprint, "hit": self.hit,
                "nearest": [n.to_dict() for n in self.nearest], "without_parts": list(self.without_parts)}


def wanted_parts_path(directory: str | Path, name: str, fingerprint: str) -> Path:
    """Where a runner records the parts record of a key it wants, in its programs ``directory``
    (beside the program, ``NAME-FP24.pt2``): ``NAME-FP24.parts.json``."""
    return Path(directory) / f"{name}-{fingerprint[:24]}.parts.json"


def _segment(key: str) -> str:
    return f"[{key}]" if "." in key or "[" in key or not key else key


def flatten(record: Mapping, prefix: str = "") -> dict[str, object]:
    """The leaves of ``record`` by path (see the module docstring); an empty object is a leaf."""
    out: dict[str, object] = {}
    for key, value in record.items():
        seg = _segment(key)
        path = f"{prefix}{seg}" if not prefix or seg.startswith("[") else f"{prefix}.{seg}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, path))
        else:
            out[path] = value
    return out


def differences(wanted: Mapping, stored: Mapping) -> tuple[Difference, ...]:
    """The leaves in which two parts records differ, sorted by path (an empty object on one side
    is not named when the other side has leaves under it: those are)."""
    a, b = flatten(wanted), flatten(stored)
    paths = sorted(p for p in set(a) | set(b) if a.get(p, ABSENT) != b.get(p, ABSENT))

    def under_other(p: str) -> bool:
        return {} in (a.get(p), b.get(p)) and any(q.startswith((p + ".", p + "[")) for q in paths)

    return tuple(Difference(p, b.get(p, ABSENT), a.get(p, ABSENT)) for p in paths if not under_other(p))


def stored_record(entry: EntryInfo) -> dict | None:
    """The entry's parts record when it has one that parses and whose fingerprint is the entry's,
    else ``None``."""
    if not entry.parts:
        return None
    try:
        record = parse_parts(entry.parts, strict=False)
    except ValueError:
        return None
    return record if fingerprint_of(record) == entry.fingerprint else None


def explain(name: str, fingerprint: str, wanted: Mapping, entries: Iterable[EntryInfo],
            limit: int = DEFAULT_NEAREST) -> Explanation:
    """Compare the ``wanted`` parts record of ``name``/``fingerprint`` with ``entries`` (those of
    other names are ignored): the ``limit`` nearest with a usable record, and those without."""
    same = [e for e in entries if e.name == name]
    hit = any(e.fingerprint == fingerprint for e in same)
    near, bare = [], []
    for e in same:
        if e.fingerprint == fingerprint:
            continue
        record = stored_record(e)
        if record is None:
            bare.append(e.fingerprint)
        else:
            near.append(Neighbour(e, differences(wanted, record)))
    near.sort(key=lambda n: (len(n.differences), -n.entry.created, n.entry.fingerprint))
    return Explanation(name, fingerprint, hit, tuple(near[:max(limit, 0)]), tuple(sorted(bare)))


def show(value: object, width: int | None = None) -> str:
    """A value as JSON (:data:`ABSENT` as is), cut to ``width`` characters with ``...``."""
    text = value if value is ABSENT else json.dumps(value, sort_keys=True)
    return text if width is None or len(text) <= width else text[:width - 3] + "..."


def one_line(explanation: Explanation) -> str:
    """A phrase for the runner's report: ``""`` on a HIT or when no entry of the name exists, else
    which parts differ from the nearest entry (``MISS: nearest llama.decode.aoti entry 3f2a...
    differs in compile_options.threads (2 -> 4)``; the first four, then how many more and the
    command that lists them), or that the entries carry no parts."""
    e = explanation
    if e.hit or not (e.nearest or e.without_parts):
        return ""
    if not e.nearest:
        return (f"MISS: {len(e.without_parts)} {e.name} entr{'y' if len(e.without_parts) == 1 else 'ies'} "
                "without fingerprint parts (published by an older warmserve)")
    n = e.nearest[0]
    diffs = ", ".join(f"{d.path} ({show(d.stored, _SHORT_VALUE)} -> {show(d.wanted, _SHORT_VALUE)})"
                      for d in n.differences[:_SHORT_COUNT])
    more = len(n.differences) - _SHORT_COUNT
    tail = f" and {more} more part{'' if more == 1 else 's'} (warmserve cache explain {e.name} {e.fingerprint})" \
        if more > 0 else ""
    return f"MISS: nearest {e.name} entry {n.entry.fingerprint[:12]} differs in {diffs}{tail}"
