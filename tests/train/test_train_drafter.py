"""`specrun train-drafter`: trains, saves a drafter that `--drafter` then loads, refuses bad input by name."""

import json

from click.testing import CliRunner

from specrun.cli import main


def test_train_drafter_cli_writes_a_drafter_generate_uses(tiny_models, tmp_path):
    data = tmp_path / "text.jsonl"
    data.write_text("".join(json.dumps({"text": f"{i} the cat sat on the mat and looked at {i + 1} birds. "}) + "\n"
                            for i in range(200)))
    out = tmp_path / "drafter"
    model = tiny_models["llama_gqa"]
    res = CliRunner().invoke(main, ["train-drafter", "--model", model, "--data", str(data), "--out", str(out),
                                    "--seq-len", "64", "--steps", "6", "--warmup", "2", "--batch-size", "2",
                                    "--ffn-size", "32", "--vocab", "100", "--depth", "2"])
    assert res.exit_code == 0, res.output
    assert "step 6/6  loss" in res.output and "top-1 agreement with the model, per level" in res.output
    assert (out / "drafter.json").is_file() and (out / "drafter.safetensors").is_file()
    res = CliRunner().invoke(main, ["generate", "--model", model, "--prompt", "the cat", "--max-tokens", "20",
                                    "--draft", "recurrent", "--drafter", str(out), "--fixed-budget", "--json"])
    assert res.exit_code == 0, res.output
    stats = json.loads(res.output)["stats"]
    assert stats["mean_trie_nodes"] > 1  # the drafter drafted (with --draft none every trie is the root alone)


def test_train_drafter_cli_refuses_bad_input(tiny_models, tmp_path):
    res = CliRunner().invoke(main, ["train-drafter", "--model", tiny_models["llama_gqa"], "--data",
                                    str(tmp_path / "nope.txt"), "--out", str(tmp_path / "d")])
    assert res.exit_code == 1 and "nope.txt' does not exist" in res.output
    res = CliRunner().invoke(main, ["generate", "--model", tiny_models["llama_gqa"], "--prompt", "x",
                                    "--draft", "recurrent"])
    assert res.exit_code != 0 and "needs a trained recurrent drafter" in res.output
    res = CliRunner().invoke(main, ["generate", "--prompt", "x", "--drafter", str(tmp_path / "missing")])
    assert res.exit_code == 2 and "is not a drafter directory" in res.output
    res = CliRunner().invoke(main, ["generate", "--model", tiny_models["llama_gqa"], "--prompt", "x",
                                    "--draft", "recurrent", "--drafter", "none"])
    assert res.exit_code != 0 and "--drafter none was given" in res.output
    res = CliRunner().invoke(main, ["train-drafter", "--help"])
    assert res.exit_code == 0 and "Examples:" in res.output and "--vocab" in res.output
