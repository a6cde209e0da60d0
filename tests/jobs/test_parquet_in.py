"""Parquet prompts: the same records as the same prompts in JSON lines; bad rows named by row number as lines are;
missing columns refused; the hash covers the file and the column choice."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from specrun.decoding.verify.params import SamplingParams
from specrun.jobs.inputs import InputError, read_prompts
from specrun.jobs.modelinfo import model_info
from specrun.jobs.parquet_in import Columns

TEXTS = ["Once upon a time", "abcabcabc", "The end."]


@pytest.fixture(scope="module")
def info(tiny_models):
    return model_info(tiny_models["llama_mha"])


def _read(info, path, columns=None):
    return read_prompts(path, info.tokenizer, info.max_context, info.vocab_size,
                        SamplingParams(max_tokens=16, temperature=1.0, seed=3), columns=columns)


def test_parquet_equals_jsonl(info, tmp_path):
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"id": f"k{i}", "prompt": t}) + "\n" for i, t in enumerate(TEXTS)))
    pq.write_table(pa.table({"key": [f"k{i}" for i in range(3)], "text": TEXTS}), tmp_path / "p.parquet",
                   row_group_size=2)  # two row groups
    want, _ = _read(info, tmp_path / "p.jsonl")
    got, sha = _read(info, tmp_path / "p.parquet", Columns(prompt="text", id="key"))
    assert [(r.id, r.line, r.input_ids, r.params, r.text) for r in got] == \
        [(r.id, r.line, r.input_ids, r.params, r.text) for r in want]
    # default columns: prompt (and id when there is one); without an id, the row number as a line's
    pq.write_table(pa.table({"prompt": TEXTS}), tmp_path / "plain.parquet")
    assert [r.id for r in _read(info, tmp_path / "plain.parquet")[0]] == ["1", "2", "3"]
    # another column choice over the same file is another input
    pq.write_table(pa.table({"a": TEXTS, "b": TEXTS}), tmp_path / "ab.parquet")
    assert _read(info, tmp_path / "ab.parquet", Columns(prompt="a"))[1] != \
        _read(info, tmp_path / "ab.parquet", Columns(prompt="b"))[1]
    assert sha != _read(info, tmp_path / "p.parquet", Columns(prompt="key", id="key"))[1]


def test_bad_rows_and_columns_are_named(info, tmp_path):
    pq.write_table(pa.table({"id": ["x", "y", "x", "z"], "text": ["fine", None, "dup", ""]}), tmp_path / "bad.parquet")
    with pytest.raises(InputError) as e:
        _read(info, tmp_path / "bad.parquet", Columns(prompt="text"))
    assert e.value.problems == ["row 2: prompt must be a string, got NoneType",
                                "row 3: duplicate id 'x' (first used on row 1)", "row 4: prompt is empty"]
    with pytest.raises(InputError, match="no column 'body'"):
        _read(info, tmp_path / "bad.parquet", Columns(prompt="body"))
    pq.write_table(pa.table({"q": ["a"]}), tmp_path / "none.parquet")
    with pytest.raises(InputError, match="no prompt column chosen"):
        _read(info, tmp_path / "none.parquet")
