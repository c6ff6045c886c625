"""Weight formats and transforms: int8/int4 weights, fp8 / MXFP8 / MXFP4 / NVFP4 (emulated), fp8 training matmuls."""
