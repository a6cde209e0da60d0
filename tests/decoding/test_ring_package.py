"""The compiled draft's packages in the cache: a package's name changes with anything that changes what it computes or
where it can run (the cache's own rules: test_aot_package.py)."""

import torch

from specrun.decoding.drafters import ring_package
from specrun.decoding.drafters.quant_ring import RingForward
from specrun.decoding.drafters.quant_torch import TorchForward
from specrun.decoding.forward import aot_package
from specrun.decoding.forward.runner import ModelRunner
from specrun.models.loader import load_model
from tests.decoding.test_quant_draft import _on_grid, model_dir  # noqa: F401 (a fixture)


def test_a_package_is_named_by_its_weights_rows_keys_threads_and_host(model_dir, monkeypatch):  # noqa: F811
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)  # an emulation of another CPU set by whoever runs this
    lm = _on_grid(load_model(str(model_dir), dtype="float32"))
    graph = RingForward(TorchForward.of(ModelRunner(lm, max_rows=4).decoder)).graph
    name = ring_package.package_name(graph, 1, 4096)
    assert name == ring_package.package_name(graph, 1, 4096) and name.startswith("draft-1-") and name.endswith(".pt2")
    assert ring_package.path(graph, 1, 4096).name == name
    assert ring_package.package_name(graph, 0, 4096) != name  # several sequences a call
    assert ring_package.package_name(graph, 1, 2048) != name  # another bound on the ring's keys
    packed = graph.layers[1].gate_up.packed
    kept = packed.clone()
    with torch.inference_mode():
        packed.view(-1)[0] ^= 1  # one code of one weight
    assert ring_package.package_name(graph, 1, 4096) != name
    with torch.inference_mode():
        packed.copy_(kept)
    assert ring_package.package_name(graph, 1, 4096) == name
    graph.layers[0].scaling *= 2  # a constant of the graph, not a tensor
    assert ring_package.package_name(graph, 1, 4096) != name
    graph.layers[0].scaling /= 2
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)  # inductor's loops are compiled for a number of threads
    try:
        assert ring_package.package_name(graph, 1, 4096) != name
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")  # the same CPU, inductor's instructions narrowed
    assert ring_package.package_name(graph, 1, 4096) != name
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    assert ring_package.package_name(graph, 1, 4096) == name
    monkeypatch.setattr(aot_package, "host", lambda: "flags : fpu sse sse2 avx2")  # another CPU
    assert ring_package.package_name(graph, 1, 4096) != name
