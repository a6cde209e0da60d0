"""Explicit Arrow schemas of every Parquet file in a job directory (prompts, progress chunks, outputs, timelines).

Changing a schema changes SCHEMA_VERSION, which the job manifest records.
"""

from __future__ import annotations

import pyarrow as pa

SCHEMA_VERSION = 3  # 2: prompts.source; 3: outputs.checksum

PROMPTS = pa.schema([
    pa.field("id", pa.string(), nullable=False),
    pa.field("line", pa.int32(), nullable=False),  # 1-based line in the input file
    pa.field("text", pa.string()),  # rendered prompt text; null when given as input_ids
    pa.field("input_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("overrides", pa.string(), nullable=False),  # JSON object of per-prompt sampling overrides
    pa.field("params", pa.string(), nullable=False),  # JSON of the effective SamplingParams (seed resolved)
    # the line's field (prompt, messages, input_ids): chat or completion in an OpenAI export; null in older jobs
    pa.field("source", pa.string()),
])

CHUNK = pa.schema([
    pa.field("start", pa.int64(), nullable=False),  # offset of the first token among the generated tokens
    pa.field("end", pa.int64(), nullable=False),
    pa.field("token_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("checksum", pa.string(), nullable=False),  # sha256 over (start, end, token bytes)
    pa.field("written_at", pa.float64(), nullable=False),
])

OUTPUT = pa.schema([
    pa.field("id", pa.string(), nullable=False),
    pa.field("token_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("text", pa.string(), nullable=False),
    pa.field("finish_reason", pa.string(), nullable=False),
    pa.field("n_tokens", pa.int64(), nullable=False),
    pa.field("prompt_tokens", pa.int64(), nullable=False),
    pa.field("resumed_tokens", pa.int64(), nullable=False),  # read back from checkpoints, re-prefilled, not regenerated
    pa.field("seconds", pa.float64(), nullable=False),  # generation seconds of the run that finished the prompt
    pa.field("steps", pa.int64(), nullable=False),  # decoding steps of that run
    pa.field("mean_accepted", pa.float64(), nullable=False),  # tokens per step of that run
    pa.field("tokens_per_s", pa.float64(), nullable=False),
    pa.field("distinct_1", pa.float64(), nullable=False),
    pa.field("distinct_2", pa.float64(), nullable=False),
    pa.field("distinct_3", pa.float64(), nullable=False),
    pa.field("distinct_4", pa.float64(), nullable=False),
    pa.field("attempts", pa.int32(), nullable=False),
    pa.field("stats", pa.string(), nullable=False),  # JSON of the engine stats
    # rowfiles.row_checksum of (id, token_ids, text, finish_reason); null in rows written before schema version 3
    pa.field("checksum", pa.string()),
])

TIMELINE = pa.schema([  # one row per checkpoint chunk of a prompt, and one for the tokens after its last chunk
    pa.field("attempt", pa.int32(), nullable=False),  # the prompt's n-th generation run (each resume or retry adds one)
    pa.field("start", pa.int64(), nullable=False),  # generated-token offsets [start, end) the row covers
    pa.field("end", pa.int64(), nullable=False),
    pa.field("steps", pa.int64(), nullable=False),  # decoding steps that produced them
    pa.field("seconds", pa.float64(), nullable=False),  # wall seconds since the attempt's previous row (or its start)
    pa.field("ended_at", pa.float64(), nullable=False),  # unix time of the row
    pa.field("phase_seconds", pa.map_(pa.string(), pa.float64()), nullable=False),  # decoding/stats.py PHASES
    pa.field("accepted_by_drafter", pa.map_(pa.string(), pa.int64()), nullable=False),  # drafted tokens accepted
    pa.field("width_steps", pa.map_(pa.int32(), pa.int64()), nullable=False),  # trie width chosen -> steps
    pa.field("host", pa.string(), nullable=False),
    pa.field("slot", pa.int32(), nullable=False),  # the worker's slot
    # null in rows written before these fields: trie nodes verified (the drafted ones: nodes - steps), and the worker
    # process's resident memory at the row, in MB (flat over a long run, or something grows with the text)
    pa.field("nodes", pa.int64()),
    pa.field("rss_mb", pa.float64()),
])
# finished prompts' timelines merged into one file by the driver's compaction (storage/timeline.py merge_timelines)
MERGED_TIMELINE = pa.schema([pa.field("id", pa.string(), nullable=False), *TIMELINE])

