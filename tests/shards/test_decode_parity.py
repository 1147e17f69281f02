"""Image decode specs match webdataset 1.0's decoder on the same bytes, and webdataset's
published ImageNet-style pipeline runs in ember."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from ember.shards import ShardDataset, ShardLoader
from ember.shards.decode import IMAGE_SPECS, Decoder

wds = pytest.importorskip("webdataset")
Image = pytest.importorskip("PIL.Image")
from webdataset.autodecode import imagespecs as WDS_SPECS  # noqa: E402


def _image(mode: str, fmt: str, size=(7, 5), seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    w, h = size
    if mode == "I;16":
        img = Image.fromarray(rng.integers(0, 65535, (h, w), dtype=np.uint16))
    elif mode == "P":
        img = Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).convert(
            "P", palette=Image.Palette.ADAPTIVE, colors=16)
    else:
        bands = len(Image.new(mode, (1, 1)).getbands())
        arr = rng.integers(0, 255, (h, w, bands), dtype=np.uint8)
        img = Image.frombytes(mode, (w, h), arr.tobytes())
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


IMAGES = [("L", "PNG", "png"), ("CMYK", "JPEG", "jpg"), ("P", "PNG", "png"),
          ("RGBA", "PNG", "png"), ("I;16", "PNG", "png"), ("RGB", "JPEG", "jpg"),
          ("LA", "PNG", "png"), ("P", "GIF", "gif")]


def test_ember_has_every_webdataset_spec():
    assert set(IMAGE_SPECS) == set(WDS_SPECS)


@pytest.mark.parametrize("spec", sorted(WDS_SPECS))
@pytest.mark.parametrize(("mode", "fmt", "ext"), IMAGES)
def test_spec_matches_webdataset(spec, mode, fmt, ext):
    data = _image(mode, fmt)
    assert Image.open(io.BytesIO(data)).mode.startswith(mode[:1])
    ours = Decoder(spec).decode_field(ext, data)
    reference = data
    if mode == "I;16":
        # the one documented difference: webdataset (Pillow's convert) clips 16-bit values at
        # 255; ember reads them as the 8-bit copy of the picture, v / 257 rounded
        wide = np.asarray(Image.open(io.BytesIO(data))).astype(np.int64)
        buf = io.BytesIO()
        Image.fromarray(((wide + 128) // 257).astype(np.uint8), "L").save(buf, format="PNG")
        reference = buf.getvalue()
    theirs = wds.autodecode.ImageHandler(spec)(ext, reference)
    if isinstance(theirs, Image.Image):
        assert isinstance(ours, Image.Image)
        assert ours.mode == theirs.mode and ours.size == theirs.size
        assert np.array_equal(np.asarray(ours), np.asarray(theirs))
        return
    assert type(ours) is type(theirs)
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    if isinstance(theirs, torch.Tensor):
        ours, theirs = ours.numpy(), theirs.numpy()
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-6)


def _preproc(img):
    # resize to a fixed size and make a tensor, as the published pipeline's transform does
    arr = np.asarray(img.resize((8, 8)), dtype=np.float32) / 255.0
    return torch.from_numpy(arr).permute(2, 0, 1)


def test_imagenet_style_chain_with_two_workers(tmp_path):
    urls = []
    modes = [("L", "PNG", "png"), ("CMYK", "JPEG", "jpg"), ("P", "PNG", "png"),
             ("RGBA", "PNG", "png"), ("RGB", "JPEG", "jpg")]
    for i in range(2):
        path = str(tmp_path / f"in-{i}.tar")
        with wds.TarWriter(path) as w:
            for j in range(20):
                mode, fmt, ext = modes[j % len(modes)]
                size = (6 + j % 4, 5 + j % 3)  # images of different sizes
                w.write({"__key__": f"{j:05d}", ext: _image(mode, fmt, size, seed=j),
                         "json": {"label": j, "shard": i}})
        urls.append(path)
    ds = (ShardDataset(urls).shuffle(1000).decode("pil")
          .rename(image="jpg;png", data="json").map_dict(image=_preproc)
          .to_tuple("image", "data").batched(8))
    seen = []
    for images, data in ShardLoader(ds, num_workers=2):
        assert images.dtype == torch.float32 and images.shape[1:] == (3, 8, 8)
        assert images.shape[0] == len(data["label"])
        seen += list(zip(data["shard"].tolist(), data["label"].tolist(), strict=True))
    assert sorted(seen) == [(i, j) for i in range(2) for j in range(20)]
