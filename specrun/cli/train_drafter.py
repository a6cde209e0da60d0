"""`specrun train-drafter`: train the recurrent drafter (sampled-text drafting) on a frozen model from text files.

Thin: loads the model, calls specrun.train.recurrent.fit_recurrent with the heads' progress bar, saves, prints metrics.
"""

from __future__ import annotations

import sys

import click

from specrun.cli.generate import load_for_cli
from specrun.cli.options import model_options
from specrun.cli.train import _Bar, training_options


@click.command("train-drafter")
@model_options
@training_options("drafter", "drafter.safetensors + drafter.json", seq_len=512, steps=1000, lr=2e-3, batch_size=8,
                  warmup=50)
@click.option("--depth", type=int, default=4, show_default=True, help="Tokens the drafter is unrolled over in training.")
@click.option("--ffn-size", type=int, default=1152, show_default=True, help="Width of the drafter's MLP.")
@click.option("--vocab", "n_vocab", type=int, default=8192, show_default=True,
              help="Tokens it can draft: the most frequent ones of the data.")
def train_drafter(model, dtype, device, trust_remote_code, data, out, seq_len, steps, lr, batch_size, warmup, depth,
                  ffn_size, n_vocab, heldout_fraction, seed):
    """Train a recurrent drafter for a model (the model stays frozen).

    From the model's hidden state and the tokens after it, the drafter guesses the model's next-token distribution a
    few tokens ahead; each level is distilled from the model itself, so it learns what sampling would pick.

    \b
    Examples:
      specrun train-drafter --model smollm2 --data generations.jsonl --out drafters/smollm2
      specrun train-drafter --model /models/Llama-3.1-8B --data a.jsonl --out d --device cuda --steps 4000
    """
    from specrun.decoding.drafters.recurrent_files import save_drafter
    from specrun.train.data import check_data_files
    from specrun.train.recurrent import fit_recurrent

    try:
        check_data_files(data)  # before the (slow) model load
    except ValueError as e:
        raise click.ClickException(str(e)) from e
    if out.exists() and not out.is_dir():
        raise click.ClickException(f"--out {str(out)!r} exists and is not a directory")
    lm = load_for_cli(model, dtype, device, trust_remote_code)
    try:
        with _Bar(steps, rich=sys.stdout.isatty(), label="training drafter") as bar:
            drafter, m = fit_recurrent(lm, list(data), seq_len=seq_len, steps=steps, lr=lr, batch_size=batch_size,
                                       warmup=warmup, depth=depth, ffn_size=ffn_size, n_vocab=n_vocab,
                                       heldout_fraction=heldout_fraction, seed=seed, progress=bar.update)
    except ValueError as e:
        raise click.ClickException(str(e)) from e
    save_drafter(drafter, out, lm, m)
    click.echo(f"trained in {m['seconds']:.1f}s on {m['train_tokens']:,} tokens; held-out {m['heldout_tokens']:,} "
               f"tokens, {m['vocab_coverage_heldout']:.1%} of them in the drafter's vocabulary")
    click.echo(f"held-out loss: {m['heldout_loss_untrained']:.4f} untrained -> {m['heldout_loss']:.4f}")
    agree = ", ".join(f"{a:.1%}" for a in m["heldout_top1_agreement_per_level"])
    click.echo(f"held-out top-1 agreement with the model, per level: {agree}")
    click.echo(f"saved to {out}")
