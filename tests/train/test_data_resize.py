"""``resize_center_crop`` and ``image_class_loader(image_size=...)``: torchvision's
``Resize(s)`` + ``CenterCrop(s)`` on PIL images, written out from torchvision's documented rule
(the shorter side becomes ``s``, the longer ``int(s * long / short)``; the crop's top-left corner
is ``round((size - s) / 2)``), compared with torchvision itself where it is installed."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from ember.shards import ShardWriter
from ember.train.data import image_class_loader, image_size_arg, resize_center_crop

Image = pytest.importorskip("PIL.Image")


def _image(width: int, height: int, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(width * 100 + height)
    arr = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(arr).convert(mode)


def _torchvision_rule(img: Image.Image, s: int) -> Image.Image:
    w, h = img.size
    short, long_ = min(w, h), max(w, h)
    new_long = int(s * long_ / short)
    size = (s, new_long) if w <= h else (new_long, s)  # (width, height)
    if size != img.size:
        img = img.resize(size, Image.BILINEAR)
    w, h = img.size
    top, left = int(round((h - s) / 2.0)), int(round((w - s) / 2.0))
    return img.crop((left, top, left + s, top + s))


@pytest.mark.parametrize("width, height, s", [(40, 30, 16), (30, 40, 16), (7, 13, 16), (16, 16, 16),
                                              (33, 33, 8), (100, 9, 9), (9, 100, 8)])
def test_square_size_is_resize_then_center_crop(width, height, s):
    img = _image(width, height)
    got = resize_center_crop(img, (s, s))
    assert got.size == (s, s)
    assert np.array_equal(np.asarray(got), np.asarray(_torchvision_rule(img, s)))


def test_matches_torchvision_when_installed():
    transforms = pytest.importorskip("torchvision.transforms")
    for w, h, s in [(40, 30, 16), (7, 13, 16), (100, 9, 9)]:
        img = _image(w, h)
        expected = transforms.CenterCrop(s)(transforms.Resize(s)(img))
        assert np.array_equal(np.asarray(resize_center_crop(img, (s, s))), np.asarray(expected))


def test_rectangular_size_covers_then_crops():
    img = _image(50, 20)
    out = resize_center_crop(img, (10, 30))  # (height, width)
    assert out.size == (30, 10)
    assert resize_center_crop(img, (20, 50)) is img  # already that size: unchanged


def test_image_size_arguments_are_checked():
    assert image_size_arg(8) == (8, 8) and image_size_arg((4, 6)) == (4, 6)
    with pytest.raises(TypeError, match="image_size"):
        image_size_arg(2.5)
    with pytest.raises(ValueError, match="image_size"):
        image_size_arg(0)


def test_loader_stacks_images_of_any_size_and_mode(tmp_path):
    def png(img):
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        return buf.getvalue()

    images = [_image(12, 9), _image(7, 15, "L"), _image(10, 10, "RGBA"), _image(16, 8, "P")]
    with ShardWriter(str(tmp_path / "s-%03d.tar"), maxcount=10) as w:
        for i, img in enumerate(images):
            w.write({"__key__": f"k{i}", "png": png(img), "cls": i % 2})
    url = str(tmp_path / "s-000.tar")
    x, y = next(iter(image_class_loader(url, 4, shuffle=0, image_size=6, split_ranks=False)))
    assert x.shape == (4, 3, 6, 6) and x.dtype == torch.float32 and y.tolist() == [0, 1, 0, 1]
    # the same values as converting and cropping by hand
    first = np.asarray(resize_center_crop(images[0].convert("RGB"), (6, 6)))
    assert torch.equal(x[0], torch.from_numpy(first.transpose(2, 0, 1).copy()).float() / 255)
    g, _ = next(iter(image_class_loader(url, 4, shuffle=0, image_size=(5, 7), grayscale=True,
                                        split_ranks=False)))
    assert g.shape == (4, 1, 5, 7)
