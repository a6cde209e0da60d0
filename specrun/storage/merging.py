"""The driver's upkeep of a job's outputs/ (the file layout of outputs.py), under the job lock: repair before a run and
compaction of parts into merged files; each output is complete and durable before the files it replaces go (I3, I4).
"""

from __future__ import annotations

import uuid

from specrun.storage import outputs
from specrun.storage.fs import is_tmp_name, move_aside
from specrun.storage.names import id_key
from specrun.storage.outputs import Compaction
from specrun.storage.rowfiles import Source, bad_rows, merge_batches, open_parquet, row_writer


def repair(store: outputs.OutputStore, keymap: dict[str, str], key) -> list[str]:
    """Before a run: remove temporaries of killed writers, read every file in full (page checksums), move
    unreadable parts and merged files aside (`.corrupt`, keeping the readable rows of a merged file in a new
    one), and remove parts already in a merged file. Afterwards every row scan() finds is readable."""
    for n in store.fs.list(store.dir):
        if is_tmp_name(n):
            store.fs.delete(store.dir / n)
    snap = store.snapshot(keymap, set_aside=True)
    problems, res = list(snap.problems), Compaction()
    covered = set()
    for src in (s for s in snap.sources if s.level > 0):
        for g in range(src.pf.metadata.num_row_groups):
            try:
                if bad := bad_rows(src.pf.read_row_group(g)):
                    src.bad.append(f"row group {g}: {len(bad)} row(s) do not match their checksum")
            except Exception as e:
                src.bad.append(f"row group {g}: {type(e).__name__}: {str(e)[:200]}")
        if src.bad:  # keep what can be read in a new file; the rest is regenerated
            problems.append(f"{src.path.name}: {'; '.join(src.bad)}")
            src.bad.clear()  # found again by the merge, which then moves the file aside
            kept = _merge(store, [src], src.level, key, res)
            if kept is not None:
                kept.close()
                covered.update(kept.ids)
        else:
            covered.update(src.ids)
    for src in (s for s in snap.sources if s.level == 0):
        if src.ids[0] in covered:
            store.fs.delete(src.path)
            continue
        try:
            with open_parquet(src.path) as pf:
                t = pf.read()
            ok = t.num_rows == 1 and t.column("id")[0].as_py() == src.ids[0] and not bad_rows(t)
            err = "it does not hold the row its name says, or its row does not match its checksum"
        except Exception as e:
            ok, err = False, f"{type(e).__name__}: {str(e)[:200]}"
        if not ok:
            problems.append(f"{src.path.name} is unreadable ({err})")
            move_aside(src.path)
    snap.close()
    return problems + res.problems


def compact(store: outputs.OutputStore, keymap: dict[str, str], key, part_ids=None, everything: bool = False,
            cancel=None, fanout: int | None = None) -> Compaction:
    """Merge the parts of `part_ids` (None: every part) into a level-1 file, then FANOUT files of a level into
    one of the next; with `everything`, leave one file. Inputs are removed only after the output is durable."""
    res, fanout = Compaction(), fanout or outputs.FANOUT  # read at call time: tests lower it
    snap = store.snapshot(keymap)
    merged = [s for s in snap.sources if s.level > 0]
    covered = {i for s in merged for i in s.ids}
    wanted = None if part_ids is None else {id_key(i) for i in part_ids}
    fresh = []
    for s in (s for s in snap.sources if s.level == 0):
        if wanted is not None and id_key(s.ids[0]) not in wanted:
            continue
        if s.ids[0] in covered:  # a crash between a merge and its removals left it
            store.fs.delete(s.path)
            res.merged_parts.append(s.ids[0])
        else:
            fresh.append(s)
    try:
        if fresh:
            merged.append(_merge(store, fresh, 1, key, res, cancel))
        while True:
            merged = [s for s in merged if s is not None]
            levels: dict[int, list[Source]] = {}
            for s in merged:
                levels.setdefault(s.level, []).append(s)
            full = [lv for lv, ss in sorted(levels.items()) if len(ss) >= fanout]
            if full:
                group = levels[full[0]]
            elif everything and len(merged) > 1:
                group = merged
            else:
                break
            out = _merge(store, group, max(s.level for s in group) + 1, key, res, cancel)
            merged = [s for s in merged if s not in group] + [out]
    finally:
        for s in merged:
            if s is not None:
                s.close()
        snap.close()
    return res


def _merge(store: outputs.OutputStore, sources: list[Source], level: int, key, res: Compaction,
           cancel=None) -> Source | None:
    """Write the rows of `sources` into one new merged file, durably, then remove them (an unreadable one is
    moved aside instead); returns the new file as a Source (None if no row was readable)."""
    path = store.dir / f"merged.{level}.{uuid.uuid4().hex[:16]}.parquet"
    written: list[str] = []
    with row_writer(path, store.schema()) as w:
        for _, pids, t in merge_batches(sources, key, cancel=cancel):
            w.add(t)
            written.extend(pids)
    done = set(written)
    res.lost.extend(sorted({i for s in sources for i in s.ids} - done))
    res.rows += len(written)
    res.files_in += len(sources)
    for s in sources:
        s.close()
        if s.bad:
            res.problems.append(f"{s.path.name}: {'; '.join(s.bad)} (moved aside as .corrupt)")
            move_aside(s.path)
        else:
            store.fs.delete(s.path)
            if s.level == 0:
                res.merged_parts.append(s.ids[0])
    if not written:
        store.fs.delete(path)
        return None
    return Source(path, written, open_parquet(path), level)
