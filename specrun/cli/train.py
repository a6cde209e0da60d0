"""`specrun train-heads`: train TokenSwift draft heads on a frozen model from .txt/.jsonl/.parquet text.

Thin: loads the model, calls specrun.train.train_heads with a rich bar (plain lines off a terminal), prints accuracy.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from specrun.cli.generate import load_for_cli
from specrun.cli.options import model_options, stack_options

PLAIN_LINES = 20  # progress lines printed over a run when stdout is not a terminal


def training_options(what: str, file_hint: str, *, seq_len: int, steps: int, lr: float, batch_size: int, warmup: int):
    """--data, --out and the optimiser flags every `train-*` command takes, with that command's defaults."""
    return stack_options(
        click.option("--data", "data", multiple=True, required=True, type=click.Path(path_type=Path),
                     help="Training text: .txt (one document per file), .jsonl (a 'text' field per line) or .parquet "
                          "(a 'text' column). Repeat for several files."),
        click.option("--out", "out", required=True, type=click.Path(file_okay=False, path_type=Path),
                     help=f"Directory to write {file_hint} into (pass it to --{what} later)."),
        click.option("--seq-len", type=int, default=seq_len, show_default=True,
                     help="Tokens per packed training sequence."),
        click.option("--steps", type=int, default=steps, show_default=True, help="Optimizer steps."),
        click.option("--lr", type=float, default=lr, show_default=True, help="Peak learning rate (AdamW)."),
        click.option("--batch-size", type=int, default=batch_size, show_default=True, help="Sequences per micro-batch."),
        click.option("--warmup", type=int, default=warmup, show_default=True,
                     help="Linear warmup steps before the cosine decay."),
        click.option("--heldout-fraction", type=float, default=0.05, show_default=True,
                     help="Share of the packed sequences held out for the final loss/accuracy."),
        click.option("--seed", type=int, default=0, show_default=True),
    )


@click.command("train-heads")
@model_options
@training_options("heads", "heads.safetensors + heads.json", seq_len=8192, steps=200, lr=5e-3, batch_size=1, warmup=50)
@click.option("--grad-accum", type=int, default=1, show_default=True, help="Micro-batches per optimizer step.")
@click.option("--weight-decay", type=float, default=0.1, show_default=True)
@click.option("--gamma", type=int, default=3, show_default=True, help="Number of chained draft heads.")
@click.option("--branch-norm", is_flag=True, help="Put an RMSNorm in front of each head's linear layer.")
def train_heads(model, dtype, device, trust_remote_code, data, out, seq_len, steps, lr, batch_size, grad_accum, warmup,
                weight_decay, heldout_fraction, gamma, branch_norm, seed):
    """Train self-drafting heads (TokenSwift) for a model; the model itself stays frozen.

    Head i learns to predict the token i+1 positions after the model's next token from the model's last hidden
    state, sharing the model's LM head. At the end each head's top-1 accuracy on held-out text is printed and saved.

    \b
    Examples:
      specrun train-heads --model /models/Llama-3.1-8B --data books.jsonl --out heads/llama8b \\
          --dtype bfloat16 --device cuda
      specrun train-heads --model /models/tiny --data a.txt --data b.parquet --out heads/tiny --seq-len 1024 --steps 100
    """
    from specrun.train import train_heads as run_training
    from specrun.train.data import check_data_files

    try:
        check_data_files(data)  # before the (slow) model load
    except ValueError as e:
        raise click.ClickException(str(e)) from e
    lm = load_for_cli(model, dtype, device, trust_remote_code)
    bar = _Bar(steps, rich=sys.stdout.isatty())
    try:
        with bar:
            metrics = run_training(lm, list(data), out, seq_len=seq_len, steps=steps, lr=lr, batch_size=batch_size,
                                   grad_accum=grad_accum, warmup=warmup, weight_decay=weight_decay,
                                   heldout_fraction=heldout_fraction, gamma=gamma, branch_norm=branch_norm, seed=seed,
                                   progress=bar.update)
    except ValueError as e:
        raise click.ClickException(str(e)) from e
    m = metrics
    click.echo(f"trained {gamma} heads in {m['seconds']:.1f}s on {m['train_tokens']:,} tokens "
               f"({m['train_sequences']} x {seq_len}); held-out {m['heldout_tokens']:,} tokens")
    click.echo(f"held-out loss (sum over heads): {m['heldout_loss_untrained']:.4f} untrained -> {m['heldout_loss']:.4f}")
    click.echo("held-out top-1 accuracy:")
    for name, acc in m["top1_accuracy"].items():
        label = "l0 (model)" if name == "l0" else name
        click.echo(f"  {label:<11} {acc:7.2%}   (untrained {m['top1_accuracy_untrained'][name]:.2%})")
    click.echo(f"saved to {out}")


class _Bar:
    """A rich progress bar with the loss on a terminal; otherwise about PLAIN_LINES plain 'step n/N loss' lines."""

    def __init__(self, steps: int, rich: bool, label: str = "training heads"):
        self.steps, self.rich, self.every, self.label = steps, rich, max(1, steps // PLAIN_LINES), label
        self.progress = self.task = None

    def __enter__(self):
        if self.rich:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(TextColumn(self.label), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("{task.fields[info]}"), TimeRemainingColumn())
            self.progress.start()
            self.task = self.progress.add_task("train", total=self.steps, info="tokenizing data")
        return self

    def __exit__(self, *exc):
        if self.progress is not None:
            self.progress.stop()
        return False

    def update(self, step: int, steps: int, loss: float, lr: float) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=step, info=f"loss {loss:.4f}  lr {lr:.2e}")
        elif step % self.every == 0 or step == steps:
            click.echo(f"step {step}/{steps}  loss {loss:.4f}  lr {lr:.2e}")
