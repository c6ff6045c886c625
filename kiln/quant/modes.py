"""The quantization modes and int4 group sizes: one list for the CLI flags and the transform."""

MODES = ("int8", "int4")
GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP_SIZE = 64
