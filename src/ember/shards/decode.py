"""Decoding sample fields by extension, with safe defaults.

The last component of an extension picks the decoder (``seg.png`` decodes as an image). Pickles and
non-weights-only ``torch.load`` stay off unless ``allow_pickle=True``; images larger than
``max_pixels`` are refused before their pixels are decoded.
"""

from __future__ import annotations

import gzip
import importlib
import io
import json
import warnings
from collections.abc import Callable
from typing import Any, cast

from ember.shards.errors import DecodeError

__all__ = ["Decoder", "IMAGE_EXTENSIONS", "IMAGE_SPECS", "handle_extension", "imagehandler",
           "MAX_PIXELS"]

IMAGE_EXTENSIONS = frozenset(
    ["jpg", "jpeg", "png", "ppm", "pgm", "pbm", "pnm", "webp", "tif", "tiff", "bmp", "gif"]
)
INT_EXTENSIONS = frozenset(("cls", "cls2", "index", "inx", "id"))
TEXT_EXTENSIONS = frozenset(("txt", "text", "transcript"))
JSON_EXTENSIONS = frozenset(("json", "jsn"))
PICKLE_EXTENSIONS = frozenset(("pyd", "pickle", "pkl"))
MSGPACK_EXTENSIONS = frozenset(("mp", "msg", "msgpack"))
CBOR_EXTENSIONS = frozenset(("cbor",))

#: default limit on width * height of decoded images (Pillow's own default)
MAX_PIXELS = 89_478_485

# spec -> (PIL mode, output kind, scale to float); as in webdataset 1.0, every spec converts to its
# mode ("pil" gives RGB) and the L specs give 2-D (H, W) arrays and tensors
IMAGE_SPECS: dict[str, tuple[str, str, bool]] = {
    "pil": ("RGB", "pil", False),
    "pilrgb": ("RGB", "pil", False),
    "pill": ("L", "pil", False),
    "pilrgba": ("RGBA", "pil", False),
    "l8": ("L", "numpy", False),
    "rgb8": ("RGB", "numpy", False),
    "rgba8": ("RGBA", "numpy", False),
    "l": ("L", "numpy", True),
    "rgb": ("RGB", "numpy", True),
    "rgba": ("RGBA", "numpy", True),
    "torchl8": ("L", "torch", False),
    "torchrgb8": ("RGB", "torch", False),
    "torchrgba8": ("RGBA", "torch", False),
    "torchl": ("L", "torch", True),
    "torchrgb": ("RGB", "torch", True),
    "torch": ("RGB", "torch", True),
    "torchrgba": ("RGBA", "torch", True),
}

Handler = Callable[[str, bytes], Any]


_SIXTEEN_BIT = ("I;16", "I;16L", "I;16B", "I;16N")


def _eight_bit(img: Any) -> Any:
    """``img`` with 16-bit samples scaled to 8 bits (v / 257, rounded), as the 8-bit copy of the
    same picture reads; Pillow's own conversion clips them at 255, so a 16-bit grayscale PNG
    would read as white. 32-bit images have no fixed range to scale from: refused."""
    if img.mode not in (*_SIXTEEN_BIT, "I", "F"):
        return img
    import numpy as np
    from PIL import Image

    if img.mode == "F":
        raise ValueError("a 32-bit float image (Pillow mode F) has no fixed range to map to 8 "
                         "bits; save it as an 8- or 16-bit image")
    arr = np.asarray(img).astype(np.int64)
    if img.mode == "I" and arr.size and (int(arr.min()) < 0 or int(arr.max()) > 65535):
        raise ValueError("a 32-bit integer image (Pillow mode I) with values outside 0..65535 "
                         "has no fixed range to map to 8 bits; save it as an 8- or 16-bit image")
    return Image.fromarray(((arr + 128) // 257).astype(np.uint8), "L")


def imagehandler(spec: str, *, max_pixels: int | None = MAX_PIXELS) -> Handler:
    """A handler decoding image extensions to ``spec`` (``pil``, ``rgb8``, ``torchrgb``, ...)."""
    if spec not in IMAGE_SPECS:
        raise ValueError(f"unknown image decode spec {spec!r}; expected one of {sorted(IMAGE_SPECS)}")
    mode, kind, scale = IMAGE_SPECS[spec]

    def handler(ext: str, data: bytes):
        if ext.rsplit(".", 1)[-1] not in IMAGE_EXTENSIONS:
            return None
        from PIL import Image

        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            try:
                img = Image.open(io.BytesIO(data))
            except Image.DecompressionBombWarning as exc:
                raise ValueError(f"image refused as a decompression bomb: {exc}") from None
            except Image.UnidentifiedImageError:
                # Pillow's message names an in-memory BytesIO object, which tells the user nothing
                raise ValueError(f"not an image Pillow can read ({len(data)} bytes starting "
                                 f"{bytes(data[:8])!r})") from None
            w, h = img.size
            if max_pixels is not None and w * h > max_pixels:
                raise ValueError(f"image of {w}x{h} pixels exceeds max_pixels={max_pixels}")
            img.load()
        img = _eight_bit(img)
        if img.mode != mode:
            img = img.convert(mode)
        if kind == "pil":
            return img
        import numpy as np

        arr = np.array(img)  # a writable copy: torch.from_numpy warns on read-only arrays
        if kind == "numpy":
            return (arr.astype(np.float32) / 255.0) if scale else arr
        import torch

        t = torch.from_numpy(arr if arr.ndim == 2 else arr.transpose(2, 0, 1).copy())
        return t.float().div_(255.0) if scale else t

    return handler


def handle_extension(extensions: str, fn: Callable[[bytes], Any]) -> Handler:
    """A handler applying ``fn(data)`` to fields whose extension is one of the space-separated
    ``extensions`` (matched as whole extensions or as their last component)."""
    wanted = set(extensions.lower().split())

    def handler(ext: str, data: bytes):
        if ext in wanted or ext.rsplit(".", 1)[-1] in wanted:
            return fn(data)
        return None

    return handler


def _basic(ext: str, data: bytes, allow_pickle: bool) -> Any:
    if ext in INT_EXTENSIONS:
        return int(bytes(data).strip())
    if ext in TEXT_EXTENSIONS:
        return bytes(data).decode("utf-8")
    if ext in JSON_EXTENSIONS:
        return json.loads(data)
    if ext == "npy":
        import numpy as np

        return np.load(io.BytesIO(data), allow_pickle=False)
    if ext == "npz":
        import numpy as np

        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    if ext == "pth":
        import torch

        return torch.load(io.BytesIO(data), weights_only=not allow_pickle, map_location="cpu")
    if ext in PICKLE_EXTENSIONS:
        if not allow_pickle:
            return _NOT_DECODED
        import pickle

        return pickle.loads(data)
    if ext in MSGPACK_EXTENSIONS:
        return _optional("msgpack", ext).unpackb(data, raw=False)
    if ext in CBOR_EXTENSIONS:
        return _optional("cbor2", ext).loads(data)
    return _NOT_DECODED


def _optional(module: str, ext: str):
    """A decoder package that is installed only by users who need it (as in webdataset)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        # not a property of the sample: raised as is, never skipped by on_error
        raise ImportError(f"decoding .{ext} needs the {module} package (pip install {module})"
                          ) from None


_NOT_DECODED = object()
_warned_pickle = False


class Decoder:
    """Decode every field of a sample dict by extension.

    ``handlers`` are tried in order (image spec strings such as ``"rgb8"`` or callables
    ``handler(ext, data) -> value or None``); then the built-in decoders for the conventional
    extensions. ``only`` restricts decoding to some extensions; fields nobody decodes stay bytes.
    """

    def __init__(self, *handlers: str | Handler, only: str | list[str] | None = None,
                 allow_pickle: bool = False, max_pixels: int | None = MAX_PIXELS):
        self.handlers: list[Handler] = [
            imagehandler(h, max_pixels=max_pixels) if isinstance(h, str) else h for h in handlers
        ]
        for h in self.handlers:
            if not callable(h):
                raise TypeError(f"decode handlers must be spec strings or callables, got {h!r}")
        if isinstance(only, str):
            only = only.split()
        self.only = None if only is None else {o.lower() for o in only}
        self.allow_pickle = allow_pickle

    def decode_field(self, ext: str, data: bytes) -> Any:
        """Decode one field; raises on malformed data."""
        inner = ext
        if ext.endswith(".gz"):
            data = gzip.decompress(data)
            inner = ext[:-3]
        for handler in self.handlers:
            value = handler(inner, data)
            if value is not None:
                return value
        value = _basic(inner.rsplit(".", 1)[-1], data, self.allow_pickle)
        if value is _NOT_DECODED:
            if inner.rsplit(".", 1)[-1] in PICKLE_EXTENSIONS:
                _warn_pickle()
            return data
        return value

    def __call__(self, sample: dict) -> dict:
        out = {}
        for ext, value in sample.items():
            if ext[:2] == "__" or not isinstance(value, (bytes, bytearray, memoryview)):
                out[ext] = value
                continue
            if self.only is not None and ext not in self.only and \
                    ext.rsplit(".", 1)[-1] not in self.only:
                out[ext] = value
                continue
            try:
                out[ext] = self.decode_field(ext, cast(bytes, value))
            except ImportError:
                raise
            except Exception as exc:
                raise DecodeError(
                    f"cannot decode field {ext!r} of sample {sample.get('__key__')!r}: {exc}",
                    sample.get("__url__"),
                ) from exc
        return out


def _warn_pickle() -> None:
    global _warned_pickle
    if not _warned_pickle:
        _warned_pickle = True
        warnings.warn("pickle fields (.pyd/.pickle/.pkl) are left as bytes: unpickling runs code "
                      "from the file. Pass allow_pickle=True to decode(...) if you trust the data.")
