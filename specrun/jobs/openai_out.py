"""OpenAI batch output lines for `specrun export --format openai`: one per finished prompt, custom_id = the prompt id,
a chat.completion for a `messages` line (/v1/chat/completions), a text_completion for any other (/v1/completions).

Ids are derived from the job and the prompt id (the same on every export); `created` is the job's creation time (a
row does not record when it finished). Jobs written before prompts.parquet recorded each line's source field export
every prompt as a text_completion.
"""

from __future__ import annotations

import hashlib

from specrun.jobs.jobdir import JobDir

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}  # ours -> OpenAI's


class OpenAIBatchLines:
    """Turns output rows of one job into OpenAI batch output objects; holds the ids of its chat prompts only."""

    def __init__(self, job: JobDir):
        m = job.manifest()
        self.model = m["model"]["arg"]  # the name the job was submitted with (the body's own "model" is not used)
        self.created = int(m.get("created_at") or 0)
        self.job_key = f"{m['input']['sha256']}:{m.get('created_at')}"
        self.chat = {pid for pid, source in job.prompt_sources() if source == "messages"}

    def __call__(self, row: dict) -> dict:
        pid, chat = row["id"], row["id"] in self.chat
        reason = FINISH_REASONS.get(row["finish_reason"])
        if reason is None:
            raise ValueError(f"prompt {pid!r}: finish_reason {row['finish_reason']!r} has no OpenAI equivalent")
        key = hashlib.sha256(f"{self.job_key}\0{pid}".encode()).hexdigest()[:24]
        out = {"message": {"role": "assistant", "content": row["text"]}} if chat else {"text": row["text"]}
        body = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{key}", "object": "chat.completion" if chat else
                "text_completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, **out, "logprobs": None, "finish_reason": reason}],
                "usage": {"prompt_tokens": row["prompt_tokens"], "completion_tokens": row["n_tokens"],
                          "total_tokens": row["prompt_tokens"] + row["n_tokens"]}}
        return {"id": f"batch_req_{key}", "custom_id": pid,
                "response": {"status_code": 200, "request_id": f"req_{key}", "body": body}, "error": None}
