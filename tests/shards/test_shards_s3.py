"""s3:// shards from a moto S3 server on loopback."""

from __future__ import annotations

from pathlib import Path

import pytest

from ember.shards import ShardDataset, ShardError
from ember.shards.urls import expand_urls


def test_reads_shards_from_s3_endpoint(shards, monkeypatch):
    moto_server = pytest.importorskip("moto.server")
    boto3 = pytest.importorskip("boto3")
    for k, v in {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x",
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    try:
        endpoint = f"http://127.0.0.1:{server._server.server_port}"
        s3 = boto3.client("s3", endpoint_url=endpoint)
        s3.create_bucket(Bucket="data")
        pattern, keys = shards
        for p in expand_urls(pattern):
            s3.put_object(Bucket="data", Key="ds/" + Path(p).name, Body=Path(p).read_bytes())
        ds = ShardDataset("s3://data/ds/s-{000..005}.tar", shuffle_shards=False,
                          s3_endpoint=endpoint)
        assert [s["__key__"] for s in ds] == keys
        with pytest.raises(ShardError, match="NoSuchKey"):
            list(ShardDataset("s3://data/ds/missing.tar", s3_endpoint=endpoint))
    finally:
        server.stop()
