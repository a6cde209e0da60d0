"""The 4-bit draft's window on our kernels (kernel_window.py): the mirror holds a sequence's sinks, its most important
older slots and its recent slots however long it grows, coded as at once; the draft over a long cache is the draft over
exactly those slots; and the output stays AR's (I1)."""

import functools

import pytest
import torch

from specrun.actors.memory import draft_window_bytes
from specrun.decoding.drafters import kernel_window, quant_draft
from specrun.decoding.drafters.kernel_window import SLIDE, DraftWindow, window_bytes, window_slots
from specrun.decoding.drafters.quant_draft import KernelForward
from specrun.decoding.drafters.quant_torch import SINKS, WINDOW
from specrun.decoding.engine import Engine, EngineConfig
from specrun.decoding.forward.decoder import FusedDecoder
from specrun.decoding.forward.kv_cache import KVCache
from specrun.decoding.forward.kv_codes import KVCodes
from specrun.decoding.kernels.cpu_kernels import cpu_kernels
from specrun.decoding.verify.params import SamplingParams
from specrun.models.loader import load_model
from tests.decoding.test_quant_draft import PROMPT, _on_grid, _slots, model_dir  # noqa: F401 (a fixture)

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="this CPU has no AVX-512 BF16 (or no C compiler)")
SMALL = {"sinks": 4, "window": 40, "slide": 16, "reserve": 8}  # a mirror of 68 slots, 80 in whole tiles


def _gathered(k: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """# k: [Lyr, Hkv, S, D], held: [Lyr, Hkv, n] -> the slots held, per layer and KV head: [Lyr, Hkv, n, D]"""
    return torch.gather(k, 2, held[..., None].expand(-1, -1, -1, k.shape[3]))


def test_the_mirror_keeps_the_sinks_the_recent_and_at_least_the_window_coded_as_at_once():
    """Steps of any size, a long jump (a resumed sequence's prefill), a query noted on the way and a new shorter
    sequence: the mirror holds, per layer and KV head, the sinks, other slots once each and at least the recent ones
    (never fewer than the window once it was rebuilt), its codes those of the held K/V coded in one call, and a draft's
    reserve always fits."""
    gen = torch.Generator().manual_seed(4)
    k, v = (torch.randn((3, 2, 400, 32), generator=gen).bfloat16() for _ in range(2))
    kernels = cpu_kernels()
    win = DraftWindow(3, 2, 32, 400, **SMALL)
    assert win.cap == 80 and win.recent == 20
    rebuilt = False
    for length in (1, 3, 10, 50, 60, 61, 75, 90, 91, 200, 201, 260, 8, 30, 399):
        if length < win.upto:  # a new sequence: other K/V in the same cache
            k, v = -k, 2 * v
        if length == 90:
            win.note_query(torch.randn((3, 4, 32), generator=gen).bfloat16())
        win.sync(kernels, k, v, length)
        held = win.held()
        n = held.shape[2]
        assert win.length == n and win.length + 8 <= win.cap, length
        assert torch.equal(win.k[:, :, :n], _gathered(k, held)) and torch.equal(win.v[:, :, :n], _gathered(v, held))
        for row in held.reshape(-1, n).tolist():
            assert row[: min(length, 4)] == list(range(min(length, 4))) and len(set(row)) == n, length
            assert set(range(max(0, length - 20), length)) <= set(row) and max(row) < length, length
        assert win.selected is None or n >= 44, length
        rebuilt |= win.selected is not None
        fresh = KVCodes(3, 2, win.cap, 32)
        fresh.sync(kernels, win.k, win.v, n)
        assert all(torch.equal(a, b) for a, b in zip(_slots(win.codes, n), _slots(fresh, n))), length
    assert rebuilt


def test_a_rebuild_keeps_the_older_slots_the_last_query_scores_highest():
    """Per layer and KV head, the slots between the sinks and the recent ones that a rebuild keeps are those whose keys
    score highest against the noted query (summed over the KV head's query heads); without a query, the latest."""
    gen = torch.Generator().manual_seed(7)
    k, v = (torch.randn((3, 2, 400, 32), generator=gen).bfloat16() for _ in range(2))
    kernels = cpu_kernels()
    win = DraftWindow(3, 2, 32, 400, **SMALL)
    win.sync(kernels, k, v, 200)
    assert win.held()[:, :, 4:].eq(torch.arange(160, 200)).all()  # no query yet: the last 40
    q = torch.randn((3, 4, 32), generator=gen).bfloat16()
    win.note_query(q)
    win.sync(kernels, k, v, 300)
    scores = torch.einsum("lhsd,lhd->lhs", k[:, :, 4:280].float(), q.float().reshape(3, 2, 2, 32).sum(2))
    chosen = win.held()[:, :, 4:24] - 4
    assert chosen.ge(0).all() and chosen.lt(276).all()
    kept = torch.zeros_like(scores, dtype=torch.bool).scatter_(2, chosen, True)
    lowest_kept = scores.masked_fill(~kept, float("inf")).amin(2)
    highest_left = scores.masked_fill(kept, float("-inf")).amax(2)
    rounding = scores.abs().amax(2) / 64  # the scores are bf16 products
    assert kept.sum(2).eq(20).all() and (lowest_kept >= highest_left - rounding).all()
    assert win.held()[:, :, 24:].eq(torch.arange(280, 300)).all()
    assert not torch.equal(chosen[0, 0], chosen[0, 1])  # each KV head its own


def test_the_rebuilds_of_a_growing_text_multiply_a_few_shapes(monkeypatch):
    """oneDNN keeps a primitive for every shape it multiplies: rebuilds that scored exactly the slots they choose from
    (a new shape every SLIDE tokens) grew a long job's worker by ~1-2 KB a token. A rebuild scores whole spans of
    SCORED_SPAN slots (or the rest of the cache), so a text's rebuilds multiply a few shapes, and still keep the
    highest-scoring slots (the test above)."""
    shapes = []
    real = kernel_window.importance
    monkeypatch.setattr(kernel_window, "importance", lambda q, k: shapes.append(tuple(k.shape)) or real(q, k))
    monkeypatch.setattr(kernel_window, "SCORED_SPAN", 256)
    gen = torch.Generator().manual_seed(5)
    k, v = (torch.randn((3, 2, 2000, 32), generator=gen).bfloat16() for _ in range(2))
    win = DraftWindow(3, 2, 32, 2000, **SMALL)
    win.note_query(torch.randn((3, 4, 32), generator=gen).bfloat16())
    for length in range(100, 2000, 20):
        win.sync(cpu_kernels(), k, v, length)
    assert win.rebuilds >= 40 and len(set(shapes)) <= 2000 // 256 + 1, (win.rebuilds, sorted(set(shapes)))


def test_a_mirror_is_no_larger_than_its_sequences_cache_can_fill():
    """A short sequence's mirror holds its cache's slots and a draft's reserve, a long one's the window's; its bytes
    (what a batched worker reserves for it) are those of the tensors it holds."""
    assert window_slots(100) == 112 + 16 and window_slots(10**6) == window_slots(SINKS + WINDOW + SLIDE)
    for capacity in (100, 5000):
        win = DraftWindow(3, 2, 32, capacity)
        assert win.cap == window_slots(capacity)
        held = win.k.nbytes + win.v.nbytes + win.codes.data.nbytes
        assert window_bytes(3, 2, 32, capacity) == held


def test_a_batched_worker_reserves_a_window_for_each_sequence_where_it_drafts_on_the_kernels(model_dir):  # noqa: F811
    lm = load_model(str(model_dir), dtype="bfloat16")
    dec = FusedDecoder.of(lm.model)
    assert draft_window_bytes(lm, EngineConfig(), 300) == window_bytes(len(dec.layers), dec.n_kv, dec.head_dim, 300)
    assert draft_window_bytes(lm, EngineConfig(drafters=("ngram",)), 300) == 0
    assert draft_window_bytes(load_model(str(model_dir), dtype="float32"), EngineConfig(), 300) == 0  # torch's int4


def test_the_draft_over_a_long_cache_is_the_draft_over_the_slots_its_window_holds(model_dir):  # noqa: F811
    """Past its window the kernel draft's logits are those of the same draft over a cache holding only the slots its
    window chose (the sinks, the important and the recent ones, at their positions), and not those of the whole
    cache."""
    lm = _on_grid(load_model(str(model_dir), dtype="bfloat16"))
    dec = FusedDecoder.of(lm.model)
    fwd = KernelForward.of(dec)
    gen = torch.Generator().manual_seed(1)
    L, Hkv, D = len(dec.layers), dec.n_kv, dec.head_dim
    cache = KVCache(L, 512, Hkv, D, torch.bfloat16, "cpu")
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen))

    def draft(over: KVCache, window: DraftWindow, length: int) -> torch.Tensor:
        fwd.windows[over] = window  # the window over's drafts keep
        fwd.begin([over], [length], 3, [over])
        return torch.cat([fwd.logits(i, [65 + i], [None], [1.0], [1e9]) for i in range(3)])

    window = DraftWindow(L, Hkv, D, 512, **SMALL)
    cache.length = 300
    draft(cache, window, 300)  # a rebuild without a query; the draft notes one
    cache.length = 400
    ours = draft(cache, window, 400)  # a rebuild that ranks the older slots by it
    held = window.held()
    assert window.rebuilds == 2 and not held[:, :, 4:24].eq(torch.arange(360, 380)).all()
    n = held.shape[2]
    short = KVCache(L, 64, Hkv, D, torch.bfloat16, "cpu")
    short.k[:, :, :n], short.v[:, :, :n] = _gathered(cache.k, held), _gathered(cache.v, held)
    short.length = n
    assert torch.equal(ours, draft(short, DraftWindow(L, Hkv, D, 64), 400))
    assert not torch.equal(ours, draft(cache, DraftWindow(L, Hkv, D, 512), 400))


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_drafting_past_many_slides_of_the_window_changes_nothing(model_dir, monkeypatch, temperature):  # noqa: F811
    """A generation ten times the window, its draft windowed: AR's tokens exactly, the window in step with the cache,
    whole drafts still accepted (this
    random model attends widely, so a 40-slot window keeps few: 1.16-1.19 tokens a step against 3.4 over the whole cache),
    and the mirror as small as the window makes it."""
    monkeypatch.setattr(quant_draft, "DraftWindow", functools.partial(DraftWindow, **SMALL))
    lm = _on_grid(load_model(str(model_dir), dtype="bfloat16"))
    dec = FusedDecoder.of(lm.model)
    dec._specrun_q4 = KernelForward.of(dec)
    params = SamplingParams(max_tokens=400, temperature=temperature, min_p=0.1, penalty=1.2, penalty_window=32,
                            seed=3, ignore_eos=True)
    ar = Engine(lm, EngineConfig(drafters=())).generate(PROMPT, params).token_ids
    engine = Engine(lm, EngineConfig(drafters=("quant",), trie_budget=4, adaptive_budget=False))
    windows = []

    def watch(emitted):
        (window,) = engine.quant.windows.values()  # the sequence's, freed with its drafter
        assert window.upto == engine.runner.cache.length  # every step's committed slots taken as they come
        windows.append(window)

    result = engine.generate(PROMPT, params, on_step=watch)
    window = windows[-1]
    assert result.token_ids == ar
    assert window.cap == 80 and window.rebuilds > 10 and window.query is not None
    assert result.stats["accepted_hist"].get("4", 0) > 0, result.stats
