"""GenStats' per-length buckets (decoding/stats.py): each bucket of generated length keeps its own steps, accepted
tokens, drafting seconds per drafted node and the process's memory, so a long run's curve reads off one generation."""

from __future__ import annotations

import pytest

from specrun.decoding.stats import LENGTH_BUCKET, GenStats


def test_each_length_bucket_keeps_its_steps_drafting_cost_and_memory():
    s = GenStats(("quant",))
    s.phase["draft"] += 0.010
    s.record_step(3, 5, 4, [0, 0], generated=0, width=5)  # a root and 4 drafted nodes, 10 ms of drafting
    s.phase["draft"] += 0.030
    s.record_step(2, 4, 3, [0], generated=3, width=4)  # 3 drafted nodes, 30 ms
    s.phase["draft"] += 0.002
    s.record_step(1, 2, 1, [], generated=LENGTH_BUCKET, width=2)  # the next bucket: 1 drafted node, 2 ms
    s.record_step(1, 1, 0, [], generated=LENGTH_BUCKET + 1, width=1)  # a width-1 step drafts nothing
    first, second = s.as_dict()["by_length"]
    assert (first["from"], first["steps"], first["mean_accepted"]) == (0, 2, 2.5)
    assert first["draft_ms_per_node"] == pytest.approx(40 / 7)
    assert (second["from"], second["steps"]) == (LENGTH_BUCKET, 2)
    assert second["draft_ms_per_node"] == pytest.approx(2.0)
    assert first["rss_mb"] > 0 and second["rss_mb"] > 0


def test_a_bucket_without_drafted_nodes_has_no_drafting_cost():
    s = GenStats(())
    s.record_step(1, 1, 0, [], generated=0, width=1)
    (only,) = s.as_dict()["by_length"]
    assert only["draft_ms_per_node"] is None and only["steps"] == 1
