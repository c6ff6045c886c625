"""The quantization modes and their settings: one list for the CLI flags and the transform (no
torch here: the CLI's parsers import it for --help)."""

MODES = ("int8", "int4", "fp8", "mxfp8", "mxfp4", "nvfp4")
GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP_SIZE = 64
FP8_FORMATS = ("e4m3", "e5m2")
FP8_SCALINGS = ("tensor", "1x128", "128x128")
