"""A local S3 server for tests: moto's server mode on 127.0.0.1 (a free port) with dummy credentials in the environment
(set before a test module starts Ray, so that its workers inherit them); each test makes its own bucket."""

from __future__ import annotations

import contextlib
import uuid
from dataclasses import dataclass

import pytest

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
               "AWS_EC2_METADATA_DISABLED": "true"}


@dataclass
class LocalS3:
    endpoint: str  # http://127.0.0.1:PORT
    client: object  # a boto3 S3 client on it

    def bucket(self) -> str:
        name = f"specrun-{uuid.uuid4().hex[:12]}"
        self.client.create_bucket(Bucket=name)
        return name

    def uri(self, bucket: str, prefix: str) -> str:
        """The URI of a job location with the endpoint in it (no AWS_ENDPOINT_URL needed)."""
        return f"s3://{bucket}/{prefix}?endpoint_override={self.endpoint.split('://')[1]}&scheme=http"

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


@contextlib.contextmanager
def local_s3(endpoint_env: bool):
    """endpoint_env: also point AWS_ENDPOINT_URL at the server (plain s3://bucket/prefix URIs then reach it)."""
    server_mod = pytest.importorskip("moto.server")
    boto3 = pytest.importorskip("boto3")
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    try:
        with pytest.MonkeyPatch.context() as mp:
            for k, v in CREDENTIALS.items():
                mp.setenv(k, v)
            if endpoint_env:
                mp.setenv("AWS_ENDPOINT_URL", endpoint)
            else:
                mp.delenv("AWS_ENDPOINT_URL", raising=False)
            yield LocalS3(endpoint, boto3.client("s3", endpoint_url=endpoint))
    finally:
        server.stop()
