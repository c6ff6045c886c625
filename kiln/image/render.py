"""Drawing scenes with Pillow: each kind is a few shapes in its unit box; a picture is a sky,
grass (and water), and the scene's objects laid out by its relation, with jitter everywhere.

Pictures are drawn at four times the output side and reduced with a Lanczos filter, so 64×64
and 32×32 come from the same drawing, antialiased. The ground truth (each object's kind,
colour and box, as fractions of the side) comes from the layout, not from looking at pixels.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

from PIL import Image, ImageDraw

from kiln.image.scenes import COLOURS, KINDS, SIZES, Group, Scene

SUPERSAMPLE = 4
RGB = tuple[int, int, int]
FIXED: dict[str, RGB] = {
    **COLOURS, "skin": (240, 195, 150), "navy": (40, 50, 100), "lightblue": (170, 215, 245),
    "trunk": (110, 70, 35), "leaf": (60, 150, 60),
}  # fmt: skip


def _star(points: int = 5, inner: float = 0.42) -> list[tuple[float, float]]:
    out = []
    for i in range(points * 2):
        a = math.pi / points * i - math.pi / 2
        r = 0.5 if i % 2 == 0 else 0.5 * inner
        out.append((0.5 + r * math.cos(a), 0.55 + r * math.sin(a)))
    return out


def _rays(n: int = 8) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    for i in range(n):
        a = 2 * math.pi * i / n
        c, s = math.cos(a), math.sin(a)
        out.append(("line", [(0.5 + 0.34 * c, 0.5 + 0.34 * s), (0.5 + 0.5 * c, 0.5 + 0.5 * s)],
                    "main", 0.07))  # fmt: skip
    return out


def _petals() -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    for i in range(5):
        a = 2 * math.pi * i / 5 - math.pi / 2
        x, y = 0.5 + 0.2 * math.cos(a), 0.28 + 0.17 * math.sin(a)
        out.append(("ellipse", (x - 0.17, y - 0.14, x + 0.17, y + 0.14), "main"))
    return out


# Shapes in the unit box (x right, y down): (kind, geometry, colour role[, line width]).
# Roles: "main" (the caption's colour), "dark"/"light" (its shades), "sky" (the background
# behind the object), or a FIXED colour name.
SHAPES: dict[str, list[tuple[Any, ...]]] = {
    "sun": [*_rays(), ("ellipse", (0.18, 0.18, 0.82, 0.82), "main")],
    "moon": [("ellipse", (0.05, 0.05, 0.95, 0.95), "main"),
             ("ellipse", (0.38, -0.05, 1.15, 0.72), "sky")],
    "star": [("poly", _star(), "main")],
    "cloud": [("ellipse", (0.0, 0.4, 0.62, 1.0), "main"), ("ellipse", (0.38, 0.35, 1.0, 1.0), "main"),
              ("ellipse", (0.18, 0.0, 0.72, 0.78), "main")],
    "bird": [("ellipse", (0.1, 0.4, 0.72, 0.8), "main"), ("ellipse", (0.6, 0.2, 0.9, 0.55), "main"),
             ("poly", [(0.25, 0.55), (0.55, 0.55), (0.3, 0.0)], "dark"),
             ("poly", [(0.88, 0.32), (1.0, 0.4), (0.88, 0.47)], "orange")],
    "kite": [("poly", [(0.5, 0.0), (1.0, 0.32), (0.5, 0.78), (0.0, 0.32)], "main"),
             ("line", [(0.5, 0.0), (0.5, 0.78)], "dark", 0.05),
             ("line", [(0.5, 0.78), (0.35, 0.9), (0.55, 1.0)], "black", 0.04)],
    "rainbow": [("arc", i, c) for i, c in enumerate(("red", "orange", "yellow", "green", "blue"))],
    "plane": [("poly", [(0.35, 0.5), (0.62, 0.5), (0.4, 1.0)], "dark"),
              ("ellipse", (0.0, 0.38, 1.0, 0.66), "main"),
              ("poly", [(0.0, 0.45), (0.16, 0.45), (0.03, 0.0)], "dark"),
              ("ellipse", (0.75, 0.42, 0.88, 0.54), "lightblue")],
    "balloon": [("line", [(0.5, 0.68), (0.42, 0.84), (0.52, 1.0)], "grey", 0.05),
                ("ellipse", (0.08, 0.0, 0.92, 0.72), "main")],
    "tree": [("rect", (0.4, 0.55, 0.6, 1.0), "trunk"), ("ellipse", (0.0, 0.0, 1.0, 0.68), "main")],
    "flower": [("line", [(0.5, 0.4), (0.5, 1.0)], "leaf", 0.1),
               ("ellipse", (0.5, 0.65, 0.85, 0.8), "leaf"), *_petals(),
               ("ellipse", (0.38, 0.17, 0.62, 0.39), "yellow")],
    "house": [("rect", (0.1, 0.45, 0.9, 1.0), "main"),
              ("poly", [(0.0, 0.48), (0.5, 0.0), (1.0, 0.48)], "dark"),
              ("rect", (0.42, 0.68, 0.6, 1.0), "trunk"), ("rect", (0.18, 0.56, 0.34, 0.72), "lightblue")],
    "castle": [("rect", (0.15, 0.35, 0.85, 1.0), "main"), ("rect", (0.0, 0.12, 0.28, 1.0), "dark"),
               ("rect", (0.72, 0.12, 1.0, 1.0), "dark"), ("rect", (0.0, 0.0, 0.08, 0.14), "dark"),
               ("rect", (0.2, 0.0, 0.28, 0.14), "dark"), ("rect", (0.72, 0.0, 0.8, 0.14), "dark"),
               ("rect", (0.92, 0.0, 1.0, 0.14), "dark"), ("ellipse", (0.38, 0.55, 0.62, 0.8), "black"),
               ("rect", (0.38, 0.68, 0.62, 1.0), "black")],
    "dog": [("line", [(0.14, 0.45), (0.0, 0.2)], "main", 0.08),
            ("rect", (0.18, 0.6, 0.3, 1.0), "main"), ("rect", (0.55, 0.6, 0.67, 1.0), "main"),
            ("ellipse", (0.08, 0.32, 0.75, 0.75), "main"), ("ellipse", (0.58, 0.1, 0.96, 0.5), "main"),
            ("ellipse", (0.56, 0.12, 0.7, 0.48), "dark"), ("ellipse", (0.8, 0.22, 0.87, 0.3), "black")],
    "cat": [("line", [(0.14, 0.62), (0.0, 0.15)], "main", 0.07),
            ("rect", (0.2, 0.7, 0.3, 1.0), "main"), ("rect", (0.52, 0.7, 0.62, 1.0), "main"),
            ("ellipse", (0.1, 0.42, 0.7, 0.82), "main"), ("ellipse", (0.56, 0.2, 0.94, 0.56), "main"),
            ("poly", [(0.58, 0.32), (0.62, 0.0), (0.74, 0.24)], "main"),
            ("poly", [(0.78, 0.24), (0.9, 0.0), (0.93, 0.32)], "main"),
            ("ellipse", (0.66, 0.32, 0.72, 0.38), "dark"), ("ellipse", (0.8, 0.32, 0.86, 0.38), "dark")],
    "bunny": [("ellipse", (0.05, 0.62, 0.25, 0.82), "white"),
              ("ellipse", (0.12, 0.45, 0.8, 1.0), "main"), ("ellipse", (0.45, 0.25, 0.88, 0.62), "main"),
              ("ellipse", (0.5, 0.0, 0.62, 0.38), "main"), ("ellipse", (0.68, 0.0, 0.8, 0.38), "main"),
              ("ellipse", (0.52, 0.06, 0.6, 0.3), "light")],
    "bear": [("ellipse", (0.12, 0.36, 0.88, 1.0), "main"), ("ellipse", (0.2, 0.02, 0.4, 0.2), "dark"),
             ("ellipse", (0.6, 0.02, 0.8, 0.2), "dark"), ("ellipse", (0.24, 0.04, 0.76, 0.48), "main"),
             ("ellipse", (0.4, 0.24, 0.6, 0.42), "light"), ("ellipse", (0.3, 0.5, 0.7, 0.9), "light")],
    "frog": [("ellipse", (0.12, 0.05, 0.42, 0.45), "main"), ("ellipse", (0.58, 0.05, 0.88, 0.45), "main"),
             ("ellipse", (0.0, 0.28, 1.0, 1.0), "main"), ("ellipse", (0.2, 0.12, 0.32, 0.28), "black"),
             ("ellipse", (0.68, 0.12, 0.8, 0.28), "black"),
             ("line", [(0.3, 0.68), (0.5, 0.76), (0.7, 0.68)], "dark", 0.05)],
    "duck": [("ellipse", (0.0, 0.38, 0.82, 1.0), "main"), ("ellipse", (0.52, 0.02, 0.9, 0.5), "main"),
             ("poly", [(0.86, 0.22), (1.0, 0.3), (0.86, 0.38)], "orange"),
             ("ellipse", (0.7, 0.16, 0.77, 0.24), "black"), ("ellipse", (0.15, 0.55, 0.55, 0.8), "dark")],
    "ball": [("ellipse", (0.0, 0.0, 1.0, 1.0), "main"), ("line", [(0.06, 0.5), (0.94, 0.5)], "white", 0.12)],
    "car": [("rect", (0.22, 0.05, 0.74, 0.42), "dark"), ("rect", (0.3, 0.12, 0.66, 0.38), "lightblue"),
            ("rect", (0.0, 0.35, 1.0, 0.8), "main"), ("ellipse", (0.1, 0.6, 0.36, 1.0), "black"),
            ("ellipse", (0.64, 0.6, 0.9, 1.0), "black")],
    "boat": [("rect", (0.47, 0.02, 0.53, 0.62), "trunk"),
             ("poly", [(0.55, 0.02), (0.55, 0.56), (0.92, 0.56)], "white"),
             ("poly", [(0.45, 0.1), (0.45, 0.56), (0.15, 0.56)], "light"),
             ("poly", [(0.0, 0.6), (1.0, 0.6), (0.8, 1.0), (0.2, 1.0)], "main")],
    "fish": [("poly", [(0.3, 0.5), (0.0, 0.08), (0.0, 0.92)], "dark"),
             ("ellipse", (0.18, 0.12, 1.0, 0.88), "main"), ("ellipse", (0.74, 0.32, 0.84, 0.46), "black")],
    "cake": [("rect", (0.05, 0.42, 0.95, 1.0), "main"), ("rect", (0.05, 0.34, 0.95, 0.5), "light"),
             ("rect", (0.44, 0.1, 0.56, 0.36), "lightblue"), ("ellipse", (0.42, 0.0, 0.58, 0.14), "orange")],
    "box": [("rect", (0.0, 0.12, 1.0, 1.0), "main"), ("rect", (0.0, 0.0, 1.0, 0.26), "dark"),
            ("rect", (0.43, 0.0, 0.57, 1.0), "light")],
    "toy": [("rect", (0.0, 0.25, 0.75, 1.0), "main"),
            ("poly", [(0.0, 0.25), (0.25, 0.0), (1.0, 0.0), (0.75, 0.25)], "light"),
            ("poly", [(0.75, 0.25), (1.0, 0.0), (1.0, 0.75), (0.75, 1.0)], "dark")],
    "dragon": [("poly", [(0.2, 0.6), (0.0, 0.3), (0.28, 0.72)], "main"),
               ("rect", (0.25, 0.75, 0.35, 1.0), "dark"), ("rect", (0.55, 0.75, 0.65, 1.0), "dark"),
               ("ellipse", (0.12, 0.4, 0.76, 0.88), "main"),
               ("poly", [(0.3, 0.5), (0.45, 0.0), (0.62, 0.5)], "dark"),
               ("ellipse", (0.62, 0.1, 0.98, 0.42), "main"), ("ellipse", (0.82, 0.18, 0.88, 0.25), "yellow")],
    "girl": [("rect", (0.34, 0.82, 0.44, 1.0), "skin"), ("rect", (0.56, 0.82, 0.66, 1.0), "skin"),
             ("poly", [(0.5, 0.26), (0.02, 0.86), (0.98, 0.86)], "main"),
             ("ellipse", (0.22, -0.02, 0.78, 0.36), "trunk"), ("ellipse", (0.3, 0.04, 0.7, 0.32), "skin")],
    "boy": [("rect", (0.26, 0.62, 0.48, 1.0), "navy"), ("rect", (0.52, 0.62, 0.74, 1.0), "navy"),
            ("rect", (0.18, 0.28, 0.82, 0.66), "main"), ("ellipse", (0.3, 0.0, 0.7, 0.3), "skin"),
            ("rect", (0.3, 0.0, 0.7, 0.08), "trunk")],
}  # fmt: skip


@dataclass(frozen=True)
class Placed:
    """One object's box in canvas pixels (x0, y0, x1, y1) and the group it belongs to."""

    group: int
    box: tuple[float, float, float, float]


def _shade(rgb: RGB, factor: float) -> RGB:
    return tuple(max(0, min(255, round(c * factor))) for c in rgb)  # type: ignore[return-value]


def _mix(a: RGB, b: RGB, t: float) -> RGB:
    return tuple(round(x + (y - x) * t) for x, y in zip(a, b, strict=True))  # type: ignore[return-value]


def _jitter(rgb: RGB, rng: random.Random, amount: int = 14) -> RGB:
    f = rng.uniform(0.88, 1.08)
    return tuple(max(0, min(255, round(c * f + rng.randint(-amount, amount)))) for c in rgb)  # type: ignore[return-value]


@dataclass
class _Backdrop:
    horizon: float  # canvas y where the sky ends
    water_top: float | None  # canvas y where water begins (None: no water)
    night: bool
    top: RGB
    bottom: RGB

    def sky_at(self, y: float) -> RGB:
        return _mix(self.top, self.bottom, max(0.0, min(1.0, y / self.horizon)))


def _backdrop(scene: Scene, side: int, rng: random.Random) -> _Backdrop:
    kinds = {g.kind for g in scene.groups}
    night = bool(kinds & {"moon", "star"}) or ("sun" not in kinds and rng.random() < 0.15)
    horizon = side * rng.uniform(0.6, 0.7)
    water = any(g.place == "water" for g in scene.groups)
    water_top = horizon + side * rng.uniform(0.08, 0.12) if water else None
    if night:
        top, bottom = _jitter((15, 25, 65), rng, 8), _jitter((55, 70, 120), rng, 8)
    else:
        top, bottom = _jitter((100, 170, 235), rng, 12), _jitter((205, 235, 250), rng, 8)
    return _Backdrop(horizon, water_top, night, top, bottom)


def _paint_backdrop(draw: ImageDraw.ImageDraw, back: _Backdrop, side: int, rng: random.Random):
    for y in range(int(back.horizon) + 1):
        draw.line([(0, y), (side, y)], fill=back.sky_at(y))
    grass = _jitter((110, 190, 90) if not back.night else (45, 90, 55), rng, 12)
    draw.rectangle((0, back.horizon, side, side), fill=grass)
    if back.water_top is not None:
        water = _jitter((60, 140, 215) if not back.night else (35, 60, 120), rng, 10)
        draw.rectangle((0, back.water_top, side, side), fill=water)


def _size_of(group: Group, side: int, rng: random.Random) -> tuple[float, float]:
    kind = KINDS[group.kind]
    scale = SIZES.get(group.size or "", 1.0) * rng.uniform(1.0, 1.25)
    return kind.width * side * scale, kind.height * side * scale


def _ground_range(group: Group, back: _Backdrop, side: int) -> tuple[float, float]:
    """Where the bottom of an object in `group`'s place may be (canvas y)."""
    if group.place == "sky":
        return side * 0.12, back.horizon - side * 0.04  # a box's bottom; its top is checked later
    if group.place == "water" and back.water_top is not None:
        return back.water_top + side * 0.06, side * 0.98
    lower = back.water_top if back.water_top is not None else side * 0.97
    return back.horizon + side * 0.03, max(back.horizon + side * 0.04, lower)


def _fit(box: list[float], side: int) -> tuple[float, float, float, float]:
    """Shift a box inside the canvas (it is never larger than it)."""
    x0, y0, x1, y1 = box
    dx = max(0.0, -x0) - max(0.0, x1 - side)
    dy = max(0.0, -y0) - max(0.0, y1 - side)
    return x0 + dx, y0 + dy, x1 + dx, y1 + dy


def _place_group(group: Group, gi: int, back: _Backdrop, side: int, rng: random.Random):
    w, h = _size_of(group, side, rng)
    shrink = min(1.0, side * 0.94 / (group.count * w * 1.08))  # three big things still fit
    w, h = w * shrink, h * shrink
    lo, hi = _ground_range(group, back, side)
    placed: list[Placed] = []
    slot = side / group.count
    for i in range(group.count):
        x = slot * i + rng.uniform(0, max(0.0, slot - w)) if group.count > 1 else None
        x0 = x if x is not None else rng.uniform(0, side - w)
        bottom = rng.uniform(lo, max(lo, hi))
        if group.place == "sky":
            bottom = max(bottom, h + side * 0.02)
        placed.append(Placed(gi, _fit([x0, bottom - h, x0 + w, bottom], side)))
    return placed


def _place_pair(scene: Scene, back: _Backdrop, side: int, rng: random.Random) -> list[Placed]:
    subject, obj = scene.groups
    (sw, sh), (ow, oh) = _size_of(subject, side, rng), _size_of(obj, side, rng)
    slo, shi = _ground_range(subject, back, side)
    olo, ohi = _ground_range(obj, back, side)
    relation = scene.relation
    if relation in ("left of", "right of"):
        gap = side * rng.uniform(0.04, 0.14)
        shrink = min(1.0, side * 0.96 / (sw + ow + gap))
        sw, sh, ow, oh, gap = sw * shrink, sh * shrink, ow * shrink, oh * shrink, gap * shrink
        start = rng.uniform(0, side - (sw + ow + gap))
        first_w = sw if relation == "left of" else ow
        sx = start if relation == "left of" else start + ow + gap
        ox = start + first_w + gap if relation == "left of" else start
        sb, ob = rng.uniform(slo, shi), rng.uniform(olo, ohi)
        if subject.place == "sky":
            sb = max(sb, sh + side * 0.02)
            ob = max(ob, oh + side * 0.02)
        s_box = [sx, sb - sh, sx + sw, sb]
        o_box = [ox, ob - oh, ox + ow, ob]
    else:
        ob = rng.uniform(olo, ohi)
        if obj.place == "sky":
            ob = max(ob, oh + side * 0.02)
        ox = rng.uniform(0, side - ow)
        o_box = [ox, ob - oh, ox + ow, ob]
        centre = ox + ow / 2 + rng.uniform(-0.2, 0.2) * min(sw, ow)
        if relation == "above":  # a sky thing over a ground thing, clear of it
            sb = o_box[1] - side * rng.uniform(0.03, 0.08)
            room = max(sb - side * 0.02, side * 0.06)
            if sh > room:  # a tall object leaves little sky: shrink the subject to fit
                sw, sh = sw * room / sh, room
        else:  # under: on the ground beneath, in front of a tree's trunk
            sb = rng.uniform(slo, shi)
            if obj.kind == "tree":
                sb = max(sb, ob + side * 0.01)
        s_box = [centre - sw / 2, sb - sh, centre + sw / 2, sb]
    return [Placed(0, _fit(s_box, side)), Placed(1, _fit(o_box, side))]


def _colour_of(group: Group, rng: random.Random) -> RGB:
    if group.colour is None:
        return (0, 0, 0)
    return _jitter(COLOURS[group.colour], rng)


def _draw_object(
    draw: ImageDraw.ImageDraw, kind: str, box: tuple[float, ...], main: RGB, back: _Backdrop
) -> None:
    x0, y0, x1, y1 = box
    w, h = x1 - x0, y1 - y0

    def pt(u: float, v: float) -> tuple[float, float]:
        return x0 + u * w, y0 + v * h

    roles = {"main": main, "dark": _shade(main, 0.62), "light": _mix(main, (255, 255, 255), 0.45)}
    for shape in SHAPES[kind]:
        what, geom, role = shape[0], shape[1], shape[2]
        if what == "arc":  # a rainbow band: geom is its index from the outside
            inset = geom * w * 0.07
            band = (x0 + inset, y0 + inset, x1 - inset, y1 + h - inset)
            draw.arc(band, 180, 360, fill=FIXED[role], width=max(1, round(w * 0.07)))
            continue
        colour = back.sky_at((y0 + y1) / 2) if role == "sky" else roles.get(role) or FIXED[role]
        if what == "ellipse":
            draw.ellipse((*pt(geom[0], geom[1]), *pt(geom[2], geom[3])), fill=colour)
        elif what == "rect":
            draw.rectangle((*pt(geom[0], geom[1]), *pt(geom[2], geom[3])), fill=colour)
        elif what == "poly":
            draw.polygon([pt(u, v) for u, v in geom], fill=colour)
        else:  # line
            width = max(1, round(shape[3] * min(w, h) * 1.6))
            draw.line([pt(u, v) for u, v in geom], fill=colour, width=width, joint="curve")


def render(scene: Scene, size: int, rng: random.Random) -> tuple[Image.Image, dict[str, Any]]:
    """The picture of `scene` (size × size RGB) and its ground truth (objects, colours, boxes)."""
    side = size * SUPERSAMPLE
    back = _backdrop(scene, side, rng)
    canvas = Image.new("RGB", (side, side))
    draw = ImageDraw.Draw(canvas)
    _paint_backdrop(draw, back, side, rng)
    if scene.relation is None:
        placed = _place_group(scene.groups[0], 0, back, side, rng)
    else:
        placed = _place_pair(scene, back, side, rng)
    colours = [_colour_of(g, rng) for g in scene.groups]
    # Things behind first: the sky, then what stands further back (higher bottom edge).
    for p in sorted(placed, key=lambda p: (scene.groups[p.group].place != "sky", p.box[3])):
        _draw_object(draw, scene.groups[p.group].kind, p.box, colours[p.group], back)
    image = canvas.resize((size, size), Image.Resampling.LANCZOS)
    objects = [
        {
            "kind": scene.groups[p.group].kind,
            "colour": scene.groups[p.group].colour,
            "group": p.group,
            "box": [round(c / side, 4) for c in p.box],
        }
        for p in placed
    ]
    truth = {**scene.to_json(), "objects": objects, "night": back.night}
    return image, truth
