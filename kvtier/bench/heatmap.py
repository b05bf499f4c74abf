"""Heatmap PNGs without image libraries: a 5×7 bitmap font, numpy for the canvas, zlib and struct for the file."""
from __future__ import annotations

import itertools
import struct
import zlib

import numpy as np

# glyph rows top to bottom, 5 bits each (the high bit is the leftmost pixel); text is drawn upper-case
FONT = {
    "0": "0e11131519110e", "1": "040c040404040e", "2": "0e11010204081f", "3": "1f02040201110e",
    "4": "02060a121f0202", "5": "1f101e0101110e", "6": "0608101e11110e", "7": "1f010204080808",
    "8": "0e11110e11110e", "9": "0e11110f01020c",
    "A": "0e11111f111111", "B": "1e11111e11111e", "C": "0e11101010110e", "D": "1c12111111121c",
    "E": "1f10101e10101f", "F": "1f10101e101010", "G": "0e11101711110f", "H": "1111111f111111",
    "I": "0e04040404040e", "J": "0702020202120c", "K": "11121418141211", "L": "1010101010101f",
    "M": "111b1515111111", "N": "11111915131111", "O": "0e11111111110e", "P": "1e11111e101010",
    "Q": "0e11111115120d", "R": "1e11111e141211", "S": "0f10100e01011e", "T": "1f040404040404",
    "U": "1111111111110e", "V": "11111111110a04", "W": "1111111515150a", "X": "11110a040a1111",
    "Y": "11110a04040404", "Z": "1f01020408101f",
    " ": "00000000000000", ".": "00000000000c0c", ",": "000000000c0408", ":": "000c0c000c0c00",
    "%": "18190204081303", "(": "02040808080402", ")": "08040202020408", "-": "0000001f000000",
    "/": "00010204081000",
}
GAP = 1                                   # font pixels between letters
BLACK, WHITE, GREY = (0, 0, 0), (255, 255, 255), (200, 200, 200)
STOPS = ((0.0, (215, 48, 39)), (0.5, (254, 224, 139)), (1.0, (26, 152, 80)))   # red → yellow → green


def encode_png(pixels: np.ndarray) -> bytes:
    """An 8-bit RGB PNG of a (height, width, 3) uint8 array: every row filtered with None (type 0)."""
    height, width, _ = pixels.shape
    rows = np.concatenate([np.zeros((height, 1), np.uint8), pixels.reshape(height, width * 3)], axis=1)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows.tobytes(), 9)) + chunk(b"IEND", b""))


def text_mask(text: str, scale: int) -> np.ndarray:
    """The text's pixels (True = ink), each font pixel scale × scale."""
    glyphs = [np.array([[row >> (4 - x) & 1 for x in range(5)] for row in bytes.fromhex(FONT[c])], bool)
              for c in text.upper()]
    spaced = [np.pad(g, ((0, 0), (0, GAP))) for g in glyphs]
    mask = np.concatenate(spaced, axis=1)[:, :-GAP] if spaced else np.zeros((7, 0), bool)
    return mask.repeat(scale, axis=0).repeat(scale, axis=1)


def draw(canvas: np.ndarray, mask: np.ndarray, top: int, left: int, color=BLACK) -> None:
    canvas[top:top + mask.shape[0], left:left + mask.shape[1]][mask] = color


def recall_color(value: float) -> tuple[int, int, int]:
    """Red at 0, yellow at 0.5, green at 1, linear in between."""
    for (x0, c0), (x1, c1) in itertools.pairwise(STOPS):
        if value <= x1:
            t = (value - x0) / (x1 - x0)
            return tuple(round(a + (b - a) * t) for a, b in zip(c0, c1))
    return STOPS[-1][1]


def write_heatmap(path: str, values: list[list[float | None]], row_labels: list[str], col_labels: list[str],
                  title: str, row_axis: str, col_axis: str, scale: int = 2) -> None:
    """A PNG grid of values in [0, 1] (None: not measured, grey 'n/a'), each cell coloured red → green and
    labelled with its percentage; row and column labels, both axis titles and the title around it."""
    pad, char_h = 6 * scale, 7 * scale
    labels = [text_mask(s, scale) for s in col_labels]
    cell_w = max(32 * scale, *(m.shape[1] + 2 * pad for m in labels))
    cell_h = 18 * scale
    rows = [text_mask(s, scale) for s in row_labels]
    axis_y = np.rot90(text_mask(row_axis, scale))         # read bottom to top
    left = pad + axis_y.shape[1] + pad + max(m.shape[1] for m in rows) + pad
    top = pad + char_h + 2 * pad
    grid_w, grid_h = cell_w * len(col_labels), cell_h * len(row_labels)
    head, axis_x = text_mask(title, scale), text_mask(col_axis, scale)
    axis_x_left = max(pad, left + (grid_w - axis_x.shape[1]) // 2)       # centred under the grid if it fits
    width = max(left + grid_w, pad + head.shape[1], axis_x_left + axis_x.shape[1]) + pad
    height = top + max(grid_h, axis_y.shape[0]) + pad + char_h + pad + char_h + pad
    canvas = np.full((height, width, 3), WHITE, np.uint8)

    draw(canvas, head, pad, pad)
    draw(canvas, axis_y, top + max(0, grid_h - axis_y.shape[0]) // 2, pad)
    for i, (mask, row) in enumerate(zip(rows, values)):
        y = top + i * cell_h
        draw(canvas, mask, y + (cell_h - char_h) // 2, left - pad - mask.shape[1])
        for j, value in enumerate(row):
            x = left + j * cell_w
            canvas[y + 1:y + cell_h - 1, x + 1:x + cell_w - 1] = GREY if value is None else recall_color(value)
            mark = text_mask("n/a" if value is None else f"{value:.0%}", scale)
            draw(canvas, mark, y + (cell_h - char_h) // 2, x + (cell_w - mark.shape[1]) // 2)
    below = top + grid_h + pad
    for j, mask in enumerate(labels):
        draw(canvas, mask, below, left + j * cell_w + (cell_w - mask.shape[1]) // 2)
    draw(canvas, axis_x, below + char_h + pad, axis_x_left)
    with open(path, "wb") as f:
        f.write(encode_png(canvas))
