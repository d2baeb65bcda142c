"""A CLEVR-like counting task drawn offline: coloured circles, squares and triangles on a
plain background, with questions such as ``How many red shapes are there?``.

Every image is a function of ``(seed, index)`` and the drawing settings alone: the scene
is drawn from its own ``random.Random``, so record ``i`` is the same whatever ``size``
asks for, and any process (the buffer, the eval actor, a rollout actor on another
machine) that renders it gets the same pixels. Images are written once as PNG files to a
cache folder and records carry their path (``image``), never pixels: a record travels in
every ``Prompt`` and ``Trajectory``, while the image is decoded only where a processor
needs it.

Shapes never overlap nor touch (each lies inside its own circle, and the circles keep a
gap apart) and are drawn without antialiasing in exact palette colours, so each shape is
one connected region of one colour: a count read off the pixels equals the scene's.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from PIL import Image, ImageDraw

from asyncrl.data.loaders import Record

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 200, 30),
    "purple": (140, 60, 180),
    "orange": (245, 130, 20),
    "gray": (110, 110, 110),
    "cyan": (30, 190, 200),
}
"""The colours a scene may use, by the name its questions say."""

KINDS = ("circle", "square", "triangle")
"""The shapes a scene may hold."""

QUESTIONS = ("color", "kind", "color_kind", "total")
"""What a question may count: shapes of a colour, of a kind, of both, or all of them."""

BACKGROUND = (235, 235, 235)
"""A light gray that is none of :data:`COLORS`."""

SHAPES_INSTRUCTION = "Count the shapes in the image and put the number in \\boxed{}."
"""Appended to each question: the ``math`` reward reads the boxed number."""

MAX_PLACEMENT_TRIES = 200
"""Draws of a position per shape before the scene is judged not to fit."""


@dataclass(frozen=True)
class Shape:
    """One shape: its kind and colour name, and the circle that holds it (centre and
    radius in pixels). A square's half side is ``0.7·r``, a triangle's circumradius ``r``."""

    kind: str
    color: str
    x: int
    y: int
    r: int


@dataclass(frozen=True)
class ShapesSettings:
    """What fixes the pixels of every image besides ``(seed, index)``."""

    image_size: int = 128
    min_shapes: int = 1
    max_shapes: int = 6
    colors: tuple[str, ...] = ("red", "green", "blue", "yellow")
    kinds: tuple[str, ...] = KINDS

    def __post_init__(self) -> None:
        if self.image_size < 32:
            raise ValueError(f"data.image_size must be >= 32 pixels, got {self.image_size}")
        if not 1 <= self.min_shapes <= self.max_shapes:
            raise ValueError(
                f"data.min_shapes ({self.min_shapes}) must be >= 1 and <= data.max_shapes "
                f"({self.max_shapes})"
            )
        names_among(self.colors, tuple(COLORS), "data.colors")
        names_among(self.kinds, KINDS, "data.kinds")

    def digest(self, seed: int) -> str:
        """A short name for the folder that holds this seed's images under these settings."""
        text = json.dumps({"seed": seed, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]


def names_among(names: Sequence[str], allowed: tuple[str, ...], key: str = "") -> list[str]:
    """``names`` when each is one of ``allowed``, none twice and some at all; else a
    ValueError that starts with ``key``."""
    where = f"{key}: " if key else ""
    if not names:
        raise ValueError(f"{where}empty: give some of {', '.join(allowed)}")
    unknown = [n for n in names if n not in allowed]
    if unknown:
        raise ValueError(f"{where}{unknown} not among {', '.join(allowed)}")
    if len(set(names)) != len(names):
        raise ValueError(f"{where}{list(names)} repeats a name")
    return list(names)


def draw_scene(settings: ShapesSettings, seed: int, index: int) -> list[Shape]:
    """The shapes of image ``index``: between ``min_shapes`` and ``max_shapes`` of them,
    each of a drawn kind and colour, placed by rejection so that no two circles come
    within ``gap`` pixels of each other or of the border."""
    rng = random.Random(f"shapes/{seed}/{index}")
    side = settings.image_size
    r_lo, r_hi = max(4, side // 16), max(5, side // 9)
    gap = max(2, side // 32)
    shapes: list[Shape] = []
    for _ in range(rng.randint(settings.min_shapes, settings.max_shapes)):
        kind, color = rng.choice(settings.kinds), rng.choice(settings.colors)
        for _ in range(MAX_PLACEMENT_TRIES):
            r = rng.randint(r_lo, r_hi)
            x = rng.randint(r + gap, side - 1 - r - gap)
            y = rng.randint(r + gap, side - 1 - r - gap)
            if all(math.hypot(x - s.x, y - s.y) >= r + s.r + gap for s in shapes):
                shapes.append(Shape(kind, color, x, y, r))
                break
        else:
            raise ValueError(
                f"data.max_shapes={settings.max_shapes} shapes do not fit without overlap on "
                f"data.image_size={side} pixels (image {index}): lower max_shapes or raise "
                f"image_size"
            )
    return shapes


def triangle_points(s: Shape) -> list[tuple[float, float]]:
    """An upright equilateral triangle inscribed in the shape's circle."""
    return [
        (s.x + s.r * math.cos(a), s.y - s.r * math.sin(a))
        for a in (math.pi / 2, math.pi / 2 + 2 * math.pi / 3, math.pi / 2 + 4 * math.pi / 3)
    ]


def render_scene(shapes: Sequence[Shape], image_size: int) -> Image.Image:
    """The scene as an RGB image (no antialiasing: every shape pixel is its exact colour)."""
    image = Image.new("RGB", (image_size, image_size), BACKGROUND)
    draw = ImageDraw.Draw(image)
    for s in shapes:
        fill = COLORS[s.color]
        if s.kind == "circle":
            draw.ellipse((s.x - s.r, s.y - s.r, s.x + s.r, s.y + s.r), fill=fill)
        elif s.kind == "square":
            h = round(0.7 * s.r)
            draw.rectangle((s.x - h, s.y - h, s.x + h, s.y + h), fill=fill)
        else:
            draw.polygon(triangle_points(s), fill=fill)
    return image


def plural(kind: str) -> str:
    return f"{kind}s"


def ask(
    shapes: Sequence[Shape], settings: ShapesSettings, rng: random.Random, kinds: Sequence[str]
) -> tuple[str, int]:
    """One question about ``shapes`` of a kind drawn from ``kinds`` (:data:`QUESTIONS`),
    and its answer. Three times in four the colour and shape asked about are those of a
    shape in the scene; else they are drawn from all that the settings allow, so that
    some answers are 0 (but not most, as asking at random would make them)."""
    what = rng.choice(kinds)
    if rng.random() < 0.75:
        seen = rng.choice(shapes)
        color, kind = seen.color, seen.kind
    else:
        color, kind = rng.choice(settings.colors), rng.choice(settings.kinds)
    if what == "color":
        return f"How many {color} shapes are there?", sum(s.color == color for s in shapes)
    if what == "kind":
        return f"How many {plural(kind)} are there?", sum(s.kind == kind for s in shapes)
    if what == "color_kind":
        count = sum(s.color == color and s.kind == kind for s in shapes)
        return f"How many {color} {plural(kind)} are there?", count
    return "How many shapes are there?", len(shapes)


def default_cache_dir() -> Path:
    """``$ASYNCRL_CACHE/shapes``, or ``~/.cache/asyncrl/shapes``."""
    root = Path(os.environ.get("ASYNCRL_CACHE", Path.home() / ".cache" / "asyncrl"))
    return root / "shapes"


def image_path(settings: ShapesSettings, seed: int, index: int, cache_dir: Path) -> Path:
    """Where image ``index`` lives: one folder per seed and settings, so that images made
    under other settings never stand in for these."""
    return cache_dir / settings.digest(seed) / f"{index:07d}.png"


def write_image(image: Image.Image, path: Path) -> None:
    """Writes a PNG through a temporary file and a rename: processes that render the same
    image at once (buffer and eval actor at start) never read a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=".png", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            image.save(f, format="PNG", optimize=True)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the image from other users
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def shapes_records(
    size: int,
    seed: int = 0,
    settings: ShapesSettings | None = None,
    questions: Sequence[str] = QUESTIONS,
    questions_per_image: int = 1,
    instruction: str = SHAPES_INSTRUCTION,
    cache_dir: str | Path | None = None,
) -> list[Record]:
    """``size`` counting records: ``question``, ``prompt`` (question and ``instruction``),
    ``answer`` (the count, as text) and ``image`` (the absolute path of its PNG). Record
    ``i`` asks about image ``i // questions_per_image``; images not yet in ``cache_dir``
    are rendered and written there. Deterministic in ``seed``."""
    settings = settings or ShapesSettings()
    if not questions:
        raise ValueError(f"data.questions is empty: give some of {', '.join(QUESTIONS)}")
    names_among(questions, QUESTIONS, "data.questions")
    if questions_per_image < 1:
        raise ValueError(f"data.questions_per_image must be >= 1, got {questions_per_image}")
    folder = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    records: list[Record] = []
    for index in range((size + questions_per_image - 1) // questions_per_image):
        shapes = draw_scene(settings, seed, index)
        path = image_path(settings, seed, index, folder)
        if not path.is_file():
            write_image(render_scene(shapes, settings.image_size), path)
        rng = random.Random(f"shapes-questions/{seed}/{index}")
        for _ in range(min(questions_per_image, size - len(records))):
            question, count = ask(shapes, settings, rng, questions)
            prompt = f"{question}\n{instruction}" if instruction else question
            records.append(
                {"question": question, "prompt": prompt, "answer": str(count), "image": str(path)}
            )
    return records
