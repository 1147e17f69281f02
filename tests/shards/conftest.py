"""Shared helpers for the ember.shards tests: small shards written in a temp directory."""

from __future__ import annotations

import io
import os
import tarfile

import pytest

from ember.shards import ShardLoader, ShardWriter


def write_shards(directory, nshards: int, per_shard: int, *, prefix: str = "s",
                 payload: int = 16, index: bool = False) -> tuple[str, list[str]]:
    """Write ``nshards`` shards of ``per_shard`` samples (with ``.idx`` files if ``index``);
    returns (brace pattern, all keys)."""
    keys = []
    with ShardWriter(os.path.join(directory, f"{prefix}-%03d.tar"), maxcount=per_shard,
                     index=index) as w:
        for i in range(nshards * per_shard):
            key = f"{prefix}{i:05d}"
            keys.append(key)
            w.write({"__key__": key, "cls": i, "bin": bytes([i % 256]) * payload})
    pattern = os.path.join(directory, f"{prefix}-{{000..{nshards - 1:03d}}}.tar")
    return pattern, keys


@pytest.fixture
def make_shards(tmp_path):
    """``make_shards(nshards, per_shard, prefix=..., payload=..., index=...)`` -> (pattern, keys)."""
    return lambda *a, **k: write_shards(tmp_path, *a, **k)


@pytest.fixture
def shards(tmp_path):
    """Six shards of ten samples each."""
    return write_shards(tmp_path, 6, 10)


def tar_bytes(members: list[tuple[str, bytes | None]]) -> bytes:
    """A tar in GNU tar's format holding ``members`` in order: ``(name, data)``, data None for a
    directory entry."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.fixture
def make_tar():
    """``make_tar([(name, data or None for a directory), ...])`` -> the bytes of that tar."""
    return tar_bytes


@pytest.fixture
def unsorted_tar(tmp_path):
    """A tar as ``tar cf x.tar -C dir .`` writes it without ``--sort=name``: a directory entry,
    then files in directory order, so sample ``./s1``'s two files are apart."""
    path = tmp_path / "unsorted.tar"
    names = ["./s1.cls", "./s0.txt", "./s0.cls", "./s2.txt", "./s2.cls", "./s1.txt"]
    path.write_bytes(tar_bytes([("./", None)] + [(n, b"1") for n in names]))
    return str(path)


def sample_key(item):
    """A sample's key; items that stages already made into keys (or batches of keys) as they are."""
    return item["__key__"] if isinstance(item, dict) else item


@pytest.fixture
def stop_and_resume():
    """``stop_and_resume(make, num_workers, stop, **loader_options)``: the keys a ShardLoader over
    ``make()`` yields before stopping after ``stop`` items, the keys a new loader resumed from its
    state yields, that loader, and the state."""

    def run(make, num_workers: int, stop: int, **options):
        loader = ShardLoader(make(), num_workers=num_workers, **options)
        head = []
        for s in loader:
            head.append(sample_key(s))
            if len(head) == stop:
                break
        state = loader.state_dict()
        resumed = ShardLoader(make(), num_workers=num_workers, **options)
        resumed.load_state_dict(state)
        return head, [sample_key(s) for s in resumed], resumed, state

    return run


def use_implementation(monkeypatch, which: str) -> None:
    """Read with the compiled per-member steps (``_speedups``) or with the pure-Python ones."""
    from ember.shards import format as fmt
    from ember.shards import tar

    if which == "python":
        monkeypatch.setattr(tar, "_scan", None)
        monkeypatch.setattr(fmt, "_compiled_group_samples", None)
    elif tar._scan is None or fmt._compiled_group_samples is None:
        pytest.skip("ember.shards._speedups is not built")


@pytest.fixture
def switch_implementation():
    """``switch_implementation(monkeypatch, "compiled" | "python")``, for tests that compare both."""
    return use_implementation


@pytest.fixture(params=["compiled", "python"])
def implementation(request, monkeypatch):
    """Runs a test once with the compiled tar scanner and grouper and once with pure Python."""
    use_implementation(monkeypatch, request.param)
    return request.param


@pytest.fixture
def s3(monkeypatch):
    """An S3 endpoint on 127.0.0.1 (moto's server) with test credentials in the environment."""
    pytest.importorskip("boto3")
    server_mod = pytest.importorskip("moto.server")
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_SESSION_TOKEN": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("EMBER_S3_ENDPOINT_URL", raising=False)
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield f"http://{host}:{port}"
    finally:
        server.stop()
