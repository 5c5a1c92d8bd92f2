"""Images in: opened safely, then preprocessed as the model's processor does (transformers'
image processors, their PIL backend), into the pixel arrays a vision tower takes.

`open_image(source, field)`: a path, bytes or a PIL image -> an RGB-ready PIL image, decoded
in full now (a truncated file fails here, not later), turned upright by its EXIF orientation
(as transformers' `load_image` does); Pillow's decompression-bomb limit is kept, and crossing
even its warning threshold is a refusal. Every failure is an ImageError naming `field`.

`ImageProcessing.preprocess(image)`: transparency composited on white, resized to the
processor's size with its resample filter (Pillow, on the 8-bit image), scaled by
`rescale_factor` in float64, then normalised in float32 — the reference's own arithmetic, so the
pixels agree with it to the last float32 bit.
"""

from __future__ import annotations

import io
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxlis.errors import MlxlisError

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

MAX_SIDE = 1 << 15  # pixels on a side: wider or taller is refused before decoding
# transformers' PILImageResampling values (PIL's) by the names preprocessor configs use
RESAMPLE = {0: Image.NEAREST, 1: Image.LANCZOS, 2: Image.BILINEAR, 3: Image.BICUBIC}


class ImageError(MlxlisError):
    """An image that cannot be used: not an image, truncated, too large."""


def open_image(source: str | Path | bytes | Image.Image, field: str = "image") -> Image.Image:
    """The image `source` holds, decoded and upright (see the module docstring)."""
    if isinstance(source, Image.Image):
        image = source
    else:
        data: Any = io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                image = Image.open(data)
                if max(image.size) > MAX_SIDE:
                    raise ImageError(
                        f"{image.size[0]} x {image.size[1]} pixels: at most {MAX_SIDE} a side",
                        field=field,
                    )
                image.load()
        except ImageError:
            raise
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
            raise ImageError(f"too many pixels to decode safely ({e})", field=field) from None
        except FileNotFoundError:
            raise ImageError(f"no such file: {source}", field=field) from None
        except UnidentifiedImageError:
            raise ImageError("not an image Pillow can read", field=field) from None
        except (OSError, SyntaxError, ValueError) as e:  # truncated or corrupt data
            raise ImageError(f"a broken image: {e}", field=field) from None
    if min(image.size) < 1:
        raise ImageError(f"an empty image ({image.size[0]} x {image.size[1]})", field=field)
    try:
        return ImageOps.exif_transpose(image)
    except (OSError, ValueError, SyntaxError) as e:
        raise ImageError(f"a broken image: {e}", field=field) from None


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, transparency composited onto white (transformers' convert_to_rgb)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


@dataclass(frozen=True)
class ImageProcessing:
    """A fixed-size processor's settings (preprocessor_config.json's names)."""

    height: int
    width: int
    resample: int = 2  # bilinear
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    do_convert_rgb: bool = True
    # pan and scan (Gemma 3): an image far from square also read in crops along its long side
    pan_and_scan: bool = False
    min_crop_size: int = 256
    max_num_crops: int = 4
    min_ratio: float = 1.2

    @classmethod
    def from_config(cls, cfg: dict[str, Any], path: str) -> ImageProcessing:
        size = cfg.get("size") or {}
        try:
            out = cls(
                height=int(size["height"]),
                width=int(size["width"]),
                resample=int(cfg.get("resample", 2)),
                rescale_factor=float(cfg.get("rescale_factor", 1 / 255)),
                image_mean=tuple(float(x) for x in cfg.get("image_mean", (0.5,) * 3)),
                image_std=tuple(float(x) for x in cfg.get("image_std", (0.5,) * 3)),
                do_convert_rgb=bool(cfg.get("do_convert_rgb", True)),
                pan_and_scan=bool(cfg.get("do_pan_and_scan") or False),
                # Gemma3Processor's defaults where the config has null
                min_crop_size=int(cfg.get("pan_and_scan_min_crop_size") or 256),
                max_num_crops=int(cfg.get("pan_and_scan_max_num_crops") or 4),
                min_ratio=float(cfg.get("pan_and_scan_min_ratio_to_activate") or 1.2),
            )
        except (KeyError, TypeError, ValueError):
            raise MlxlisError(
                "expected size {height, width} and numeric processor settings",
                path=path,
                field="size",
            ) from None
        for flag in ("do_resize", "do_rescale", "do_normalize"):
            if cfg.get(flag) is False:
                raise MlxlisError(f"{flag} false is not supported", path=path, field=flag)
        if out.resample not in RESAMPLE or len(out.image_mean) != 3 or len(out.image_std) != 3:
            raise MlxlisError(
                "a resample filter or mean / std it cannot use", path=path, field="resample"
            )
        return out

    def crops(self, image: Image.Image) -> list[Image.Image]:
        """Pan and scan's crops of the RGB image (none when off, near square or too small),
        as Gemma3ImageProcessor.pan_and_scan cuts them: 2 to max_num_crops equal slices of
        the long side, the last one cut at the edge."""
        if not self.pan_and_scan:
            return []
        rgb = to_rgb(image) if self.do_convert_rgb else image
        w, h = rgb.size
        wide = w >= h
        long, short = (w, h) if wide else (h, w)
        if long / short < self.min_ratio:
            return []
        n = min(int(math.floor(long / short + 0.5)), int(math.floor(long / self.min_crop_size)))
        n = min(self.max_num_crops, max(2, n))
        nw, nh = (n, 1) if wide else (1, n)
        cw, ch = int(math.ceil(w / nw)), int(math.ceil(h / nh))
        if min(cw, ch) < self.min_crop_size:
            return []
        return [
            rgb.crop((x, y, min(x + cw, w), min(y + ch, h)))
            for y in range(0, ch * nh, ch)
            for x in range(0, cw * nw, cw)
        ]

    def preprocess(self, image: Image.Image) -> np.ndarray:
        """(3, height, width) float32 pixels, as the reference processor gives them."""
        rgb = to_rgb(image) if self.do_convert_rgb else image
        resized = rgb.resize((self.width, self.height), resample=RESAMPLE[self.resample])
        x = np.moveaxis(np.asarray(resized), -1, 0)  # (3, H, W) uint8
        x = (x.astype(np.float64) * self.rescale_factor).astype(np.float32)
        mean = np.array(self.image_mean, np.float32)[:, None, None]
        std = np.array(self.image_std, np.float32)[:, None, None]
        return (x - mean) / std
