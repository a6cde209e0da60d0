"""The driver's output compaction: finished prompts' part files are merged into merged files (storage/outputs.py) in a
background thread once PARTS_PER_MERGE have accumulated, and at the end of a run; when every prompt is done the
outputs end as one Parquet file in input order. The merged rows' timelines are merged with them (storage/timeline.py).

One compaction at a time, only in the process that holds the job lock; it is crash-safe at any point (a merged file
appears complete or not at all, and its inputs are removed only after), and cancellable (a second Ctrl-C).
Compaction is best-effort: a failure (disk full) is a warning, and the parts stay until the next attempt.
"""

from __future__ import annotations

import threading

import specrun.storage.outputs as outputs
from specrun.storage.records import Records
from specrun.storage.timeline import merge_timelines


class Compactor:
    def __init__(self, rec: Records, ids: list[str], parts_per_merge: int | None = None):
        self.rec, self.ids = rec, ids
        self.parts_per_merge = parts_per_merge or outputs.PARTS_PER_MERGE
        self.pending: list[str] = []  # prompts whose row is in a part file not yet handed to a merge
        self.messages: list[str] = []  # warnings from the thread, for the driver to show
        self.lost: list[str] = []  # prompts whose row turned out unreadable: not done any more
        self.merges = 0
        self._thread: threading.Thread | None = None
        self._cancel = threading.Event()

    def add(self, prompt_id: str) -> None:
        """A prompt's part was written; start a background merge when enough have accumulated."""
        self.pending.append(prompt_id)
        if len(self.pending) >= self.parts_per_merge and not self.busy:
            ids, self.pending = self.pending, []
            self._thread = threading.Thread(target=self._run, args=(ids, False), name="specrun-compaction",
                                            daemon=True)
            self._thread.start()

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self, part_ids: list[str] | None, everything: bool) -> None:
        try:
            res = self.rec.compact(self.ids, part_ids, everything, self._cancel)
        except InterruptedError:
            self.pending.extend(part_ids or ())
            return
        except Exception as e:  # disk full, I/O error: the parts stay; the next compaction retries
            self.pending.extend(part_ids or ())
            self.messages.append(f"output compaction failed ({type(e).__name__}: {e}); the rows are safe in their "
                                 f"part files and are merged later")
            return
        self.merges += 1
        self.messages.extend(res.problems)
        # the timelines follow their output rows; a finished job sweeps them all (those a crash left unmerged too)
        try:
            merge_timelines(self.rec.root, self.ids if everything else res.merged_parts, fold=everything)
        except Exception as e:  # best-effort like the outputs' merge: the files stay readable where they are
            self.messages.append(f"timeline compaction failed ({type(e).__name__}: {e}); the report still reads them, "
                                 f"and the job's last compaction merges them")
        if res.lost:
            self.lost.extend(res.lost)
            self.messages.append(f"{len(res.lost)} output row(s) were unreadable and are not done any more "
                                 f"({', '.join(map(repr, res.lost[:5]))}{', ...' if len(res.lost) > 5 else ''}); "
                                 f"`specrun resume` generates them again")

    def finish(self, everything: bool) -> None:
        """At the end of a run: wait for a running merge, then merge every part left (and, with `everything`, all
        outputs into one file)."""
        self.wait()
        self._run(None, everything)

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def cancel(self) -> None:
        """Stop a running merge at once (its temporary file is removed; nothing is lost)."""
        self._cancel.set()
        self.wait()
        self._cancel.clear()

    def drain(self) -> list[str]:
        out, self.messages = self.messages, []
        return out
