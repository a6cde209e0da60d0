"""The roofline's byte count: what one decode step reads, and nothing twice (fused views, tied LM head)."""

import torch

from specrun.bench.roofline import read_bandwidth, roofline, step_weight_bytes
from specrun.decoding.forward.paged_runner import kv_bytes_per_token
from specrun.models.loader import load_model


def test_step_reads_every_weight_but_the_embedding_table(tiny_models):
    for name in ("llama_gqa", "llama_mha"):
        lm = load_model(tiny_models[name], dtype="float32")
        model = lm.model
        embed = model.get_input_embeddings().weight
        head = model.get_output_embeddings().weight
        params = {p.data_ptr(): p for p in model.parameters()}  # tied weights once
        expected = sum(p.nbytes for p in params.values()) - embed.nbytes
        if head.data_ptr() == embed.data_ptr():
            expected += head.nbytes  # the tied table is read whole as the LM head
        assert step_weight_bytes(lm) == expected


def test_roofline_bounds_the_step(tiny_models):
    lm = load_model(tiny_models["llama_gqa"], dtype="float32")
    roof = roofline(lm, 100)
    assert roof["kv_bytes"] == 100 * kv_bytes_per_token(lm.model.config, torch.float32)
    assert roof["min_seconds_per_token"] == (roof["weight_bytes"] + roof["kv_bytes"]) / roof["bandwidth_bytes_per_s"]
    assert read_bandwidth(torch.device("cpu"), megabytes=8, repeats=1) > 0
