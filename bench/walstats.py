"""Where a stretch of WAL went: pg_waldump's records added up by relation, with their full-page images.

pg_waldump prints one line per record: its resource manager, its length without and with the page
images it carries (``len (rec/tot)``), what it does (``desc: INSERT_LEAF ...``) and the blocks it
touches (``blkref #0: rel 1663/5/16390 blk 12 FPW``: ``FPW`` means the whole page is in the record).
Added up per relation this says which table or index the WAL of an effect is spent on, and how much
of it is page images after a checkpoint rather than the rows themselves.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

_LINE = re.compile(r"^rmgr: (\w+)\s+len \(rec/tot\):\s*(\d+)/\s*(\d+),.*?desc: (\w+)")
_BLOCK = re.compile(r"blkref #\d+: rel \d+/\d+/(\d+)(?: fork \w+)? blk \d+( FPW)?")


@dataclass
class Spent:
    records: int = 0
    record_bytes: int = 0  # the records without their page images
    images: int = 0
    image_bytes: int = 0  # page images as stored (compressed with wal_compression)

    @property
    def total(self) -> int:
        return self.record_bytes + self.image_bytes


@dataclass
class Breakdown:
    by_relation: dict[str, Spent] = field(default_factory=dict)
    by_kind: dict[str, Spent] = field(default_factory=dict)

    def total(self) -> Spent:
        out = Spent()
        for s in self.by_relation.values():
            out.records += s.records
            out.record_bytes += s.record_bytes
            out.images += s.images
            out.image_bytes += s.image_bytes
        return out


def lsn_text(lsn: int) -> str:
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


def add_up(lines: Iterable[str], names: dict[str, str]) -> Breakdown:
    """Add up pg_waldump's lines; ``names`` maps a relfilenode to its relation's name."""
    out = Breakdown()
    for line in lines:
        match = _LINE.match(line)
        if match is None:
            continue
        rmgr, rec, tot, desc = match.group(1), int(match.group(2)), int(match.group(3)), match.group(4)
        blocks = _BLOCK.findall(line)
        # The record is counted against the first block it touches; its images against theirs.
        first = names.get(blocks[0][0], f"relfilenode {blocks[0][0]}") if blocks else f"({rmgr})"
        images = [names.get(node, f"relfilenode {node}") for node, fpw in blocks if fpw]
        for key, table in ((first, out.by_relation), (f"{rmgr} {desc}", out.by_kind)):
            spent = table.setdefault(key, Spent())
            spent.records += 1
            spent.record_bytes += rec
        if images:
            # pg_waldump gives the images' bytes only in all: share them out evenly among the blocks.
            each, kind = (tot - rec) / len(images), out.by_kind[f"{rmgr} {desc}"]
            for name in images:
                spent = out.by_relation.setdefault(name, Spent())
                spent.images += 1
                spent.image_bytes += round(each)
                kind.images += 1
                kind.image_bytes += round(each)
    return out


def breakdown(waldump: Path, pg_wal: Path, start: int, end: int, names: dict[str, str]) -> Breakdown:
    """pg_waldump over [start, end) of the WAL in ``pg_wal``, added up (see :func:`add_up`)."""
    proc = subprocess.Popen(
        [str(waldump), "-p", str(pg_wal), "-s", lsn_text(start), "-e", lsn_text(end)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    out = add_up(proc.stdout, names)
    proc.wait()
    return out


def describe(found: Breakdown, per: int, top: int = 8) -> list[str]:
    """The relations and record kinds that took most WAL, per effect (``per`` effects in the stretch)."""
    total = found.total()
    lines = [
        f"WAL by relation (pg_waldump; per new effect): {total.total / per:,.0f} B in "
        f"{total.records / per:.1f} records, of it {total.image_bytes / per:,.0f} B in "
        f"{total.images / per:.2f} full-page images"
    ]
    for title, table in (("relation", found.by_relation), ("record", found.by_kind)):
        ranked = sorted(table.items(), key=lambda kv: -kv[1].total)[:top]
        lines.append(
            f"  by {title}: "
            + "; ".join(
                f"{name} {s.total / per:,.0f} B ({s.records / per:.2f} rec, {s.images / per:.2f} FPI "
                f"{s.image_bytes / per:,.0f} B)"
                for name, s in ranked
            )
        )
    return lines
