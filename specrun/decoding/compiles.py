"""What an engine compiles, and when: its layers (EngineConfig.compile_layers, forward/compiled.py) and its 4-bit
self-draft's graph (compile_draft, drafters/quant_ring.py), each built once per machine and model, loaded after.

Compiles(config, runner, rows, solo) decides at the engine's start ("on") and for the tokens its generations ask
(expect): a compile never changes what AR emits beyond a near tie (docs/design.md section 2), only how fast.
"""

from __future__ import annotations

import sys

from specrun.decoding.config import EngineConfig
from specrun.decoding.drafters import quant_draft as qd


class Compiles:
    def __init__(self, config: EngineConfig, runner, rows: int, solo: bool):
        # rows: the most rows of one of the engine's forwards (a width a sequence, every sequence)
        self.config, self.runner, self.rows, self.several = config, runner, rows, not solo
        self.layers_error: str | None = None  # why compile_layers auto's build failed (the eager layers then run)
        if config.compile_layers == "on":
            runner.use_compiled(rows)

    def draft(self, quant):
        """The engine's 4-bit forward as it starts: compiled with the layers (compile_layers on)."""
        return qd.compiled_draft(quant, batched=self.several) if quant is not None \
            and self.config.compile_layers == "on" else quant

    def drafting(self, quant):
        """The 4-bit forward a step drafts with, or None: with several sequences a step under compile_draft auto, not
        the eager draft on the CPU (its forward for every sequence cost more than it saved: docs/benchmarks.md, stop
        68), so auto drafts from the compiled one (cached, or built once the generations ask enough); off: eagerly."""
        eager = self.several and self.config.compile_draft == "auto" and qd.compilable(quant)
        return None if eager else quant

    def _layers_due(self, tokens: int) -> bool:
        from specrun.decoding.forward import compiled  # its custom op registers only where an engine asks

        return not self.runner.compiled and self.layers_error is None and self.config.layers_compile(
            tokens, lambda: compiled.eligible(self.runner.decoder), self._layers_cached)

    def _layers_cached(self) -> bool:
        from specrun.decoding.forward import compiled

        return compiled.cached(self.runner.decoder, self.rows)

    def would_build(self, tokens: int, quant) -> list[str]:
        """What expect(tokens) would compile that the cache lacks (a minute or more each, not a load)."""
        draft = qd.compilable(quant) and self.config.draft_compiles(tokens) and not qd.draft_cached(quant, self.several)
        layers = self._layers_due(tokens) and not self._layers_cached()
        return [what for what, due in (("the layers", layers), ("the quantized self-draft", draft)) if due]

    def expect(self, tokens: int, quant):
        """Compile (or load) what generations asking `tokens` new tokens in all pay for; returns the 4-bit forward
        to draft with from now on."""
        if self._layers_due(tokens):
            try:
                self.runner.use_compiled(self.rows, measured=True)
            except Exception as e:  # noqa: BLE001 (export and inductor raise many kinds; "on" built at start, raising)
                self.layers_error = f"{type(e).__name__}: {e}"  # the eager layers serve, said once
                print(f"specrun: the layers did not compile ({self.layers_error}); they run eagerly", file=sys.stderr,
                      flush=True)
        if quant is not None and self.config.draft_compiles(tokens, lambda: qd.draft_cached(quant, self.several)):
            quant = qd.compiled_draft(quant, self.several)
        return quant
